"""The scheduler's step loop: EngineCore on its own thread, fed by commands, publishing per-request events.

gRPC handlers never touch the EngineCore (it is not thread-safe): they enqueue commands, applied between steps.
Each step's outputs are handed to `publish` in one call; the server turns them into stream messages on the event
loop while this thread is already blocked in the next step's Execute RPC (the GIL is released while waiting), so
output handling of step N overlaps the execution of step N+1.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from engine_core.config import EngineConfig
from engine_core.core_output import SeqOutput, ending_outputs
from engine_core.engine import EngineCore
from engine_core.request import FinishReason, Request
from engine_core.stats import EngineStats
from services.common.timeutil import monotonic_to_ns
from services.scheduler.config import SchedulerConfig
from services.scheduler.executor import RemoteExecutor, WorkerGroupInfo, WorkerMismatchError

log = structlog.get_logger(__name__)


@dataclass
class RequestEvent:
    """What one step (or command) did to one request."""

    request_id: str
    outputs: list[SeqOutput] = field(default_factory=list)
    finished: bool = False
    error: str = ""
    scheduled_ns: int = 0
    first_token_ns: int = 0
    finished_ns: int = 0


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's snapshot plus what only the loop knows (readiness, step timings)."""

    ready: bool = False
    engine: EngineStats = field(default_factory=EngineStats)
    steps: int = 0
    step_seconds: float = 0.0
    worker_seconds: float = 0.0


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FinishChoice:
    request_id: str
    index: int
    stop: str


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _FinishChoice | _Stop
Publish = Callable[[list[RequestEvent]], None]


class EngineLoop:
    def __init__(self, config: SchedulerConfig, publish: Publish, on_ready: Callable[[bool], None]) -> None:
        self.config = config
        self.publish = publish
        self.on_ready = on_ready
        self.executor = RemoteExecutor(config.worker_addrs, config.step_timeout, config.tls)
        self.info: WorkerGroupInfo | None = None
        self.core: EngineCore | None = None
        self.stats = SchedulerStats()  # NOTE: replaced whole after each iteration, so readers see one snapshot
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._requests: dict[str, Request] = {}  # in the core, unfinished
        self._steps = 0
        self._step_s = 0.0
        self._worker_s = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal: BaseException | None = None

    # ---- called from any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, request: Request) -> None:
        self._commands.put(_Add(request))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def finish_choice(self, request_id: str, index: int, stop: str) -> None:
        self._commands.put(_FinishChoice(request_id, index, stop))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True  # NOTE: also ends a start-up still waiting for the workers
        self._commands.put(_Stop())
        self._thread.join(timeout)
        self.executor.close()

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._init_engine()
            while not self._stopping:
                self._iteration()
        except WorkerMismatchError as e:
            self.fatal = e
            log.error("workers disagree", error=str(e))
            self.on_ready(False)
        except BaseException as e:  # NOTE: a dead engine thread must be visible, never a silent hang
            self.fatal = e
            log.exception("engine loop crashed")
            self._fail_all(f"scheduler failure: {e}")
            self.on_ready(False)

    def _init_engine(self) -> None:
        """Connects to the workers, sizes and allocates the KV cache, builds a fresh EngineCore."""
        while not self._stopping:
            try:
                info = self.executor.connect(self.config.worker_timeout)
                if info.max_num_seqs < self.config.max_num_seqs:
                    raise WorkerMismatchError(
                        f"the workers hold {info.max_num_seqs} sequences per batch but the scheduler's "
                        f"max_num_seqs is {self.config.max_num_seqs}: lower it or raise the workers'"
                    )
                num_blocks = self.config.num_kv_blocks or info.num_kv_blocks
                self.executor.init_cache(num_blocks)
                break
            except (grpc.RpcError, TimeoutError) as e:
                log.warning("workers not ready, retrying", workers=self.config.worker_addrs, error=str(e))
                time.sleep(1.0)
        else:
            return
        engine_config = EngineConfig(
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            scheduling_policy=self.config.scheduling_policy,
            enable_prefix_caching=self.config.enable_prefix_caching,
            num_kv_blocks=num_blocks,
        )
        core = EngineCore(engine_config, self.executor, info.max_model_len, num_blocks)
        self.info, self.core = info, core
        self._publish_stats()
        log.info("engine ready", workers=len(self.config.worker_addrs), blocks=num_blocks, model=info.model)
        self.on_ready(True)

    def _iteration(self) -> None:
        core = self.core
        assert core is not None
        events: dict[str, RequestEvent] = {}
        for cmd in self._take_commands(block=not core.has_unfinished):
            self._apply(core, cmd, events)
        if self._stopping:
            return
        t0 = time.perf_counter()
        self.executor.last_worker_s = 0.0
        try:
            outputs = core.step()
        except grpc.RpcError as e:
            self._recover(f"worker failure: {e.code().name}: {e.details()}")
            return
        if self.executor.last_worker_s:
            self._steps += 1
            self._step_s += time.perf_counter() - t0
            self._worker_s += self.executor.last_worker_s
        for out in outputs:
            self._event(events, out.request_id).outputs.append(out)
        for request_id, event in events.items():
            request = self._requests.get(request_id)
            if request is None:
                continue
            if not core.has_request(request_id):
                event.finished = True
                del self._requests[request_id]
            t = request.timings
            event.scheduled_ns = monotonic_to_ns(t.first_scheduled)
            event.first_token_ns = monotonic_to_ns(t.first_token)
            event.finished_ns = monotonic_to_ns(t.finished)
        if events:
            self.publish(list(events.values()))
        self._publish_stats()

    def _take_commands(self, block: bool) -> list[_Command]:
        cmds: list[_Command] = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, core: EngineCore, cmd: _Command, events: dict[str, RequestEvent]) -> None:
        if isinstance(cmd, _Stop):
            self._stopping = True
        elif isinstance(cmd, _Add):
            request = cmd.request
            try:
                core.add_request(request)
            except ValueError as e:  # NOTE: the server validates first; this is the last line of defence
                event = self._event(events, request.request_id)
                event.error = str(e)
                event.outputs = ending_outputs(request, FinishReason.ERROR)
                event.finished = True
                return
            self._requests[request.request_id] = request
        elif isinstance(cmd, _Abort):
            request = self._requests.get(cmd.request_id)
            if request is not None:
                self._end(request, core.abort(cmd.request_id), events)
        elif isinstance(cmd, _FinishChoice):
            outs = core.finish_choice(cmd.request_id, cmd.index, FinishReason.STOP_STRING, cmd.stop)
            if outs:
                self._event(events, cmd.request_id).outputs.extend(outs)

    def _end(self, request: Request, outputs: list[SeqOutput], events: dict[str, RequestEvent]) -> None:
        """Reports a request that ended outside a step (abort, error) with its last outputs."""
        event = self._event(events, request.request_id)
        event.outputs.extend(outputs)
        event.finished = True
        self._requests.pop(request.request_id, None)

    @staticmethod
    def _event(events: dict[str, RequestEvent], request_id: str) -> RequestEvent:
        event = events.get(request_id)
        if event is None:
            event = events[request_id] = RequestEvent(request_id)
        return event

    def _fail_all(self, error: str) -> None:
        events: dict[str, RequestEvent] = {}
        for request in list(self._requests.values()):
            # NOTE: the core may be broken (a worker failed mid-step): the outputs come from the request alone.
            self._event(events, request.request_id).error = error
            self._end(request, ending_outputs(request, FinishReason.ERROR), events)
        if events:
            self.publish(list(events.values()))

    def _recover(self, error: str) -> None:
        """A worker failed mid-step: its cache and batch are gone, so every request in flight fails; then the
        workers are re-initialized under a new epoch and a fresh EngineCore (empty prefix cache) takes over."""
        log.error("step failed: failing in-flight requests and re-initializing the workers", error=error)
        self.on_ready(False)
        self._fail_all(error)
        self.core = None
        self._publish_stats()
        self._init_engine()

    def _publish_stats(self) -> None:
        core = self.core
        self.stats = SchedulerStats(
            ready=core is not None,
            engine=core.stats() if core is not None else EngineStats(),
            steps=self._steps,
            step_seconds=self._step_s,
            worker_seconds=self._worker_s,
        )
