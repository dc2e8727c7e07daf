"""The offline `LLM`'s tensor-parallel ranks 1..N-1: worker processes it starts itself (multiprocessing spawn, as
vLLM's multiprocessing executor does); rank 0 runs in the `LLM`'s own process.

Each rank process loads its shard, reports the KV blocks that fit, then serves commands from its pipe: `init`
(form the group at the rendezvous address, fresh KV cache), `step` (execute the plan; every rank gets the same
one), `stop`. A rank whose step raises reports the error on its pipe and exits: the collective rank 0 is in then
fails at once (gloo sees the closed socket) instead of waiting for a peer that will never come.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import structlog

from engine_core.config import EngineConfig
from engine_core.plan import SchedulerOutput

log = structlog.get_logger(__name__)

START_TIMEOUT_S = 600.0  # a rank's model load (cold page cache, a large model on a shared host)
STOP_TIMEOUT_S = 10.0


@dataclass
class InitCache:
    num_blocks: int
    dist_init_addr: str
    epoch: str


@dataclass
class Step:
    plan: SchedulerOutput


@dataclass
class Stop:
    pass


@dataclass
class RankFailed:
    rank: int
    error: str


class RankProcessError(RuntimeError):
    """A tensor-parallel rank died or failed: the group cannot run another step (create a new `LLM`)."""


def free_loopback_addr() -> str:
    """A loopback host:port for rank 0's rendezvous (free when asked; the group binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank_main(config: EngineConfig, model_dir: str, rank: int, conn: Connection) -> None:
    """A rank process's body: load the shard, then obey the pipe until `Stop` or a failure."""
    from engine_core.distributed.parallel_state import form_group, leave_group
    from engine_core.worker.model_runner import ModelRunner

    try:
        runner = ModelRunner(config, model_dir, rank=rank)
        conn.send(runner.profile_num_blocks())
        while True:
            command = conn.recv()
            if isinstance(command, Step):
                runner.execute(command.plan)
            elif isinstance(command, InitCache):
                form_group(runner.tp, command.dist_init_addr, runner.device, command.epoch)
                runner.reset()
                runner.init_kv_cache(command.num_blocks)
            else:
                break
    except (EOFError, KeyboardInterrupt):
        pass  # the LLM's process went away: nothing to report to
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(RankFailed(rank, traceback.format_exc()))
        os._exit(1)  # NOTE: at once, no teardown: the peers' collectives must see this rank gone, not wait on it
    finally:
        leave_group()


class RankProcesses:
    """Ranks 1..size-1 of one `LLM`: started by `start`, stopped by `stop` (also at interpreter exit)."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        size = config.tensor_parallel_size
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(config, model_dir, rank, theirs), name=f"pagoda-tp-rank{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self.broken: str | None = None
        atexit.register(self.stop)

    def wait_loaded(self) -> list[int]:
        """Each rank's KV blocks that fit, once its shard is loaded."""
        return [self._recv(rank, START_TIMEOUT_S) for rank in range(1, len(self.procs) + 1)]

    def init_cache(self, num_blocks: int, addr: str, epoch: str) -> None:
        """Asks every rank to (re-)form the group at `addr` with a fresh cache; rank 0 joins it after this."""
        self._send(InitCache(num_blocks, addr, epoch))

    def send_step(self, plan: SchedulerOutput) -> None:
        self._send(Step(plan))

    def failure(self, cause: BaseException) -> RankProcessError:
        """What rank 0's failed step means: a rank's own report if one came, else the rank that is gone."""
        self.broken = self.broken or self._reported() or self._dead() or f"rank 0 failed: {cause!r}"
        return RankProcessError(f"tensor-parallel group failed: {self.broken}")

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(Stop())
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        atexit.unregister(self.stop)

    def _send(self, command: InitCache | Step) -> None:
        if self.broken is not None:
            raise RankProcessError(f"tensor-parallel group failed earlier: {self.broken}; create a new LLM")
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(command)
            except OSError as e:
                raise self.failure(e) from e
            if not self.procs[rank - 1].is_alive():
                raise self.failure(RuntimeError(f"rank {rank} is gone"))

    def _recv(self, rank: int, timeout: float) -> int:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        if not conn.poll(timeout):
            raise self.failure(TimeoutError(f"rank {rank} did not load its shard in {timeout:.0f} s"))
        try:
            message = conn.recv()
        except EOFError as e:
            proc.join(STOP_TIMEOUT_S)
            raise self.failure(e) from e
        if isinstance(message, RankFailed):
            self.broken = f"rank {message.rank} failed:\n{message.error}"
            raise RankProcessError(f"tensor-parallel group failed: {self.broken}")
        return int(message)

    def _reported(self) -> str | None:
        for conn in self.conns:
            with contextlib.suppress(OSError, EOFError):
                while conn.poll(0.5):
                    message = conn.recv()
                    if isinstance(message, RankFailed):
                        return f"rank {message.rank} failed:\n{message.error}"
        return None

    def _dead(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            proc.join(0.5)
            if not proc.is_alive():
                return f"rank {rank} exited (code {proc.exitcode})"
        return None
