"""The scheduler's step loop: EngineCore on its own thread, fed by commands, publishing per-request events.

gRPC handlers never touch the EngineCore (it is not thread-safe): they enqueue commands, applied between steps.
Each step's outputs are handed to `publish` in one call; the server turns them into stream messages on the event
loop while this thread is already blocked in the next step's Execute RPC (the GIL is released while waiting), so
output handling of step N overlaps the execution of step N+1.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog
from prometheus_client import CollectorRegistry

from engine_core.core.kv_events import KvEvent, KvEventBuffer
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput, ending_outputs
from engine_core.engine import EngineCore
from engine_core.stats import EngineStats
from services.common.telemetry import Telemetry
from services.scheduler.config import SchedulerConfig
from services.scheduler.executor import RemoteExecutor, StepDeadline, WorkerGroupInfo, WorkerMismatchError
from services.scheduler.failover import FailureCounts
from services.scheduler.loop_commands import (
    AbortCommand,
    AddCommand,
    Command,
    CommandQueue,
    FinishChoiceCommand,
    StopCommand,
)
from services.scheduler.metrics import RecoveryMetrics, ResetReason, StepMetrics
from services.scheduler.request_events import Events, Publish, event_for
from services.scheduler.tracing import StepTracer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's snapshot plus what only the loop knows (readiness, step timings)."""

    ready: bool = False
    engine: EngineStats = field(default_factory=EngineStats)
    steps: int = 0
    step_seconds: float = 0.0
    worker_seconds: float = 0.0


PublishKv = Callable[[list[KvEvent]], None]


class EngineLoop:
    def __init__(
        self,
        config: SchedulerConfig,
        publish: Publish,
        on_ready: Callable[[bool], None],
        telemetry: Telemetry | None = None,
        registry: CollectorRegistry | None = None,
        publish_kv: PublishKv | None = None,
    ) -> None:
        self.config = config
        self.publish = publish
        self.publish_kv = publish_kv
        # NOTE: filled by the block pool on this thread, handed over once per iteration (off: no buffer, no cost).
        self._kv_events = KvEventBuffer() if publish_kv is not None else None
        self.on_ready = on_ready
        self.registry = registry
        self.executor = RemoteExecutor(
            config.worker_addrs,
            StepDeadline(config.step_timeout, config.step_timeout_per_token),
            config.tls,
            config.dist_init_addr,
        )
        if telemetry is not None and telemetry.detailed:
            self.executor.step_tracer = StepTracer(telemetry.tracer)
        self.info: WorkerGroupInfo | None = None
        self.core: EngineCore | None = None
        self.stats = SchedulerStats()  # NOTE: replaced whole after each iteration, so readers see one snapshot
        self._commands = CommandQueue()
        self._requests: dict[str, Request] = {}  # in the core, unfinished
        self._steps = 0
        self._step_s = 0.0
        self._worker_s = 0.0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal: BaseException | None = None
        self.failures = 0  # worker failures, hangs and failed steps recovered from
        self.recovery = RecoveryMetrics(registry) if registry is not None else None
        self.failure_counts = FailureCounts()
        self._failed_at: float | None = None  # when the last group failure with requests resumed was detected

    # ---- called from any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, request: Request) -> None:
        self._commands.put(AddCommand(request))

    def abort(self, request: Request) -> None:
        self._commands.put(AbortCommand(request))

    def finish_choice(self, request: Request, index: int, stop: str) -> None:
        self._commands.put(FinishChoiceCommand(request, index, stop))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True  # NOTE: also ends a start-up still waiting for the workers
        self._commands.put(StopCommand())
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
            self._fail_all(f"scheduler failure: {e}", "UNAVAILABLE")
            self.on_ready(False)

    def _init_engine(self, deadline: float | None = None) -> bool:
        """Connects to the workers, sizes and allocates the KV cache (InitCache under a new epoch on every rank),
        builds a fresh EngineCore. Retries until it succeeds, the loop stops or the monotonic `deadline` passes
        (returns False then)."""
        while not self._stopping:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                info = self.executor.connect(self.config.worker_timeout if left is None else min(left, 60.0))
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
                time.sleep(1.0 if left is None else max(0.0, min(1.0, left)))
        else:
            return False
        engine_config = self.config.engine_config(info.block_size, info.max_model_len, num_blocks)
        core = EngineCore(engine_config, self.executor, info.max_model_len, num_blocks)
        if self._kv_events is not None:
            # NOTE: a fresh engine has an empty cache: whatever a router knew of the previous one is gone.
            self._kv_events.take()
            self._kv_events.cleared()
            core.scheduler.kv.pool.events = self._kv_events
        if self.registry is not None and self.executor.step_metrics is None:
            self.executor.step_metrics = StepMetrics(self.registry, info.model)
        if self.recovery is not None:
            self.recovery.start(info.model)
        self.info, self.core = info, core
        self._flush_kv()
        self._publish_stats()
        log.info("engine ready", workers=len(self.config.worker_addrs), blocks=num_blocks, model=info.model)
        self.on_ready(True)
        return True

    def _iteration(self) -> None:
        core = self.core
        assert core is not None
        events: Events = {}
        idle = not core.has_unfinished
        cmds = self._commands.take(block_s=self.config.heartbeat_interval if idle else None)
        for cmd in cmds:
            self._apply_isolated(core, cmd, events)
        if self._stopping or (idle and not cmds):
            self._flush(events)
            self._flush_kv()
            if not self._stopping:
                self._heartbeat()
            return
        t0 = time.perf_counter()
        self.executor.last_worker_s = 0.0
        try:
            outputs = core.step()
        except grpc.RpcError as e:
            self._flush(events)
            deadline = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            reason = ResetReason.STEP_DEADLINE if deadline else ResetReason.WORKER_ERROR
            self._recover(f"worker failure: {e.code().name}: {e.details()}", "UNAVAILABLE", reason)
            return
        except Exception as e:
            # NOTE: an engine or conversion bug: the core's state is suspect, so the requests it holds fail (with
            # INTERNAL) and it is rebuilt; the scheduler itself keeps serving.
            log.exception("step failed")
            self._flush(events)
            self._recover(f"scheduler step failed: {type(e).__name__}: {e}", "INTERNAL", ResetReason.STEP_ERROR)
            return
        if self._failed_at is not None and outputs:
            log.info("streams resumed", seconds=round(time.monotonic() - self._failed_at, 3))  # failure -> first token
            self._failed_at = None
        if self.executor.last_worker_s:
            self._steps += 1
            self._step_s += time.perf_counter() - t0
            self._worker_s += self.executor.last_worker_s
        for out in outputs:
            owner = self._requests.get(out.request_id)  # NOTE: step outputs belong to the request in the core
            if owner is not None:
                event = event_for(events, owner)
                event.outputs.append(out)
                if out.error:
                    # NOTE: one row of the step failed (ModelRunnerOutput.errors): its request ends with INTERNAL,
                    # not the retryable UNAVAILABLE of a worker failure; the engine already ended its choices.
                    event.error, event.error_code = out.error, "INTERNAL"
        for request, event in events.items():
            if self._requests.get(request.request_id) is not request:
                continue  # ended by a command (abort, error): its event is already final
            if not core.has_request(request.request_id):
                event.finished = True
                del self._requests[request.request_id]
            t = request.timings
            event.times = (t.first_scheduled, t.first_token, t.finished)
        self._flush(events)
        self._flush_kv()
        self._publish_stats()

    def _flush(self, events: Events) -> None:
        if events:
            self.publish(list(events.values()))

    def _flush_kv(self) -> None:
        if self._kv_events is not None and self.publish_kv is not None and self._kv_events.events:
            self.publish_kv(self._kv_events.take())

    def _heartbeat(self) -> None:
        """Idle: is every worker alive, answering and still on our cache epoch? (A step's deadline covers busy.)"""
        problem = self.executor.heartbeat(self.config.heartbeat_timeout)
        if problem:
            self._recover(f"worker failure: {problem}", "UNAVAILABLE", ResetReason.HEARTBEAT)

    def _apply_isolated(self, core: EngineCore, cmd: Command, events: Events) -> None:
        """Applies one command; if handling it raises, only its request fails (INTERNAL), never the loop."""
        try:
            self._apply(core, cmd, events)
        except Exception as e:
            request = getattr(cmd, "request", None)
            log.exception("command failed", command=type(cmd).__name__)
            if request is None:
                return
            if self._requests.get(request.request_id) is request:
                with contextlib.suppress(Exception):  # NOTE: best effort: free its blocks if the core can
                    core.abort(request.request_id)
            self._fail(request, f"failed while handling the request: {type(e).__name__}: {e}", "INTERNAL", events)

    def _apply(self, core: EngineCore, cmd: Command, events: Events) -> None:
        if isinstance(cmd, StopCommand):
            self._stopping = True
        elif isinstance(cmd, AddCommand):
            request = cmd.request
            try:
                core.add_request(request)
            except ValueError as e:  # NOTE: the server validates first; this is the last line of defence
                self._fail(request, str(e), "INVALID_ARGUMENT", events)
                return
            self._requests[request.request_id] = request
        elif isinstance(cmd, AbortCommand):
            request = cmd.request
            if self._requests.get(request.request_id) is request:
                self._end(request, core.abort(request.request_id), events)
        elif isinstance(cmd, FinishChoiceCommand) and self._requests.get(cmd.request.request_id) is cmd.request:
            outs = core.finish_choice(cmd.request.request_id, cmd.index, FinishReason.STOP_STRING, cmd.stop)
            event_for(events, cmd.request).outputs.extend(outs)

    def _end(self, request: Request, outputs: list[SeqOutput], events: Events) -> None:
        """Reports a request that ended outside a step (abort, error) with its last outputs."""
        event = event_for(events, request)
        event.outputs.extend(outputs)
        event.finished = True
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]

    def _fail(self, request: Request, error: str, code: str, events: Events) -> None:
        event = event_for(events, request)
        event.error, event.error_code = error, code
        # NOTE: the core may be broken (a worker failed mid-step): the outputs come from the request alone.
        self._end(request, ending_outputs(request, FinishReason.ERROR), events)

    def _fail_all(self, error: str, code: str = "INTERNAL", keep_unscheduled: bool = False) -> list[Request]:
        """Fails every request in flight; with `keep_unscheduled`, those never scheduled are returned instead (a
        worker failure did not touch them: they run on the next engine)."""
        events: Events = {}
        kept: list[Request] = []
        for request in list(self._requests.values()):
            if keep_unscheduled and request.timings.first_scheduled is None:
                kept.append(request)
                del self._requests[request.request_id]
            else:
                self._fail(request, error, code, events)
        self._flush(events)
        return kept

    def _recover(self, error: str, code: str, reason: ResetReason) -> None:
        """A worker failed, hung or lost its cache (`code` UNAVAILABLE), or a step raised (INTERNAL): the group is
        re-formed (every rank reset under a new epoch, the cache re-initialised) and a fresh EngineCore (empty prefix
        cache) takes over. After a worker failure the requests that ran on the workers resume on it, recomputed
        (`EngineCore.readmit`), except poison ones (failover.py); after a step error their state is suspect and they
        fail. If the group is not back within --worker-reform-timeout, the waiting streams end UNAVAILABLE
        (retryable) and the scheduler keeps trying for new requests."""
        started = time.monotonic()
        log.error("worker group failed: re-forming it", error=error, reason=reason.value)
        self.failures += 1
        model = self.info.model if self.info is not None else ""
        if self.recovery is not None and self.info is not None:
            self.recovery.reset(model, reason)
        self.on_ready(False)
        if code == "UNAVAILABLE":
            held = list(self._requests.values())
            self._requests.clear()
            triage = self.failure_counts.triage(held)
            events: Events = {}
            for request in triage.poison:
                self._fail(
                    request, f"{error} (in flight at {self.failure_counts.strikes} worker group failures)", code, events
                )
            self._flush(events)
            kept = triage.resume
        else:
            kept = self._fail_all(error, code, keep_unscheduled=True)
            triage = None
        self.core = None
        self._publish_stats()
        if not self._init_engine(deadline=started + self.config.worker_reform_timeout):
            why = f"{error}; the worker group was not re-formed within {self.config.worker_reform_timeout:g} s"
            events = {}
            for request in kept:
                self._fail(request, why if not self._stopping else error, code, events)
            self._flush(events)
            if self._stopping or not self._init_engine():  # NOTE: keeps trying, for the requests still to come
                return
            kept = []
        core = self.core
        assert core is not None
        events = {}
        for request in kept:
            self._readmit(core, request, events)
        self._flush(events)
        resumed = sum(1 for r in kept if self._requests.get(r.request_id) is r and r.timings.first_scheduled)
        self._failed_at = started if resumed else None
        if self.recovery is not None and triage is not None:
            self.recovery.failover(model, resumed, len(triage.poison))
        log.info(
            "worker group re-formed",
            reason=reason.value,
            seconds=round(time.monotonic() - started, 3),
            resumed=resumed,
            queued=len(kept) - resumed,
            failed_as_poison=len(triage.poison) if triage is not None else 0,
        )

    def _readmit(self, core: EngineCore, request: Request, events: Events) -> None:
        """One held request onto the fresh engine; if that raises, it alone fails (INTERNAL)."""
        try:
            if request.timings.first_scheduled is None:
                request.seqs = []  # NOTE: never scheduled: nothing to carry over, it starts as new
                core.add_request(request)
            else:
                core.readmit(request)
        except Exception as e:
            log.exception("re-admission failed", request_id=request.request_id)
            self._fail(request, f"failed while resuming the request: {type(e).__name__}: {e}", "INTERNAL", events)
            return
        self._requests[request.request_id] = request

    def _publish_stats(self) -> None:
        core = self.core
        self.stats = SchedulerStats(
            ready=core is not None,
            engine=core.stats() if core is not None else EngineStats(),
            steps=self._steps,
            step_seconds=self._step_s,
            worker_seconds=self._worker_s,
        )
