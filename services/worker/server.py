"""The worker process: a gRPC server around one ModelRunner.

The server starts first (health NOT_SERVING), then loads the model in a thread, then reports SERVING. Steps run on
a single dedicated thread, in order: the runner's persistent batch is only valid if no step is skipped, so a step
out of sequence or for another cache epoch is refused with FAILED_PRECONDITION (the scheduler then re-initializes).
With async scheduling the next step arrives while one runs; one that overtakes its predecessor on the way waits
for it (`ORDER_WAIT_S`) before it is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog

from engine_core.checkpoint.model_files import model_name, resolve_model_dir
from engine_core.distributed.parallel_state import form_group, leave_group
from engine_core.structured_output.backend import GrammarCompile
from engine_core.worker.host_allocator import retain_freed_memory
from engine_core.worker.model_runner import ModelRunner
from services.common.grpc_opts import SERVER_OPTIONS
from services.common.health import ServiceHealth
from services.common.logs import configure_logging
from services.common.metrics import serve_metrics, service_registry
from services.common.signals import ignore_late_signals, shutdown_event
from services.common.telemetry import Telemetry, setup_tracing
from services.common.tls import add_port
from services.convert.plan import plan_from_proto, result_to_proto
from services.rpc import WORKER_SERVICE, worker_pb2, worker_pb2_grpc
from services.worker.config import WorkerConfig, parse_worker_args
from services.worker.metrics import WorkerMetrics
from services.worker.tracing import record_execute

log = structlog.get_logger(__name__)

ORDER_WAIT_S = 5.0  # how long a step that arrived before its predecessor waits for it (then it is refused)
# NOTE: no step for this long and the heap's freed room goes back to the kernel: longer than any gap inside a burst
# (steps run back to back; a 2,048-token prefill step is ~2.5 s but counts as busy while it runs), short against the
# idle time between bursts.
IDLE_RELEASE_S = 1.0


class StepError(Exception):
    """A request the worker must refuse with FAILED_PRECONDITION."""


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, config: WorkerConfig, metrics: WorkerMetrics | None = None, telemetry: Telemetry | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.telemetry = telemetry
        self.runner: ModelRunner | None = None
        self.model_dir: str | None = None
        self.epoch = ""
        self.num_blocks = 0
        self.rank = 0  # from InitCache: an attribute of this worker's Execute spans
        self.next_step = 0  # the step thread's: the next step it runs
        self.queued_steps = 0  # the event loop's: steps of this epoch handed to the step thread
        self._order = asyncio.Condition()
        self.profiled_blocks: int | None = None
        self.last_step_at = time.monotonic()
        self.executing = 0  # Execute calls in progress (waiting for their turn or running)
        # NOTE: one thread owns the runner: steps are strictly ordered and torch runs outside the event loop.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # Grammars compiled (the compile thread's) and matchers made (the step thread's) since the last step.
        self._compiles: list[GrammarCompile] = []

    def load(self) -> None:
        engine = self.config.engine
        self.model_dir = resolve_model_dir(engine.model, engine.cache_dir)
        self.runner = ModelRunner(engine, self.model_dir, rank=self.config.rank)
        if self.runner.grammar_backend is not None:
            self.runner.grammar_backend.on_compile = self._on_compile

    def _on_compile(self, event: GrammarCompile) -> None:
        self._compiles.append(event)

    async def Profile(
        self, request: worker_pb2.ProfileRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ProfileResponse:
        runner = self.runner
        if runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert runner is not None
        engine = self.config.engine
        info = runner.info
        return worker_pb2.ProfileResponse(
            model=model_name(engine.model),
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_model_len=runner.max_model_len,
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            num_kv_blocks=self._profile(runner),
            block_bytes=info.block_bytes,
            device=engine.device,
            dtype=engine.dtype,
        )

    def _profile(self, runner: ModelRunner) -> int:
        """Blocks that fit, measured once. NOTE: re-measured with the cache allocated, free GPU memory would omit
        the cache itself and the cache would shrink at every re-initialization."""
        if self.profiled_blocks is None or not self.num_blocks:
            self.profiled_blocks = runner.profile_num_blocks()
        return self.profiled_blocks

    async def Heartbeat(
        self, request: worker_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.HeartbeatResponse:
        return worker_pb2.HeartbeatResponse(epoch=self.epoch, next_step=self.next_step)

    async def InitCache(
        self, request: worker_pb2.InitCacheRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InitCacheResponse:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if request.num_blocks < 2 or not request.epoch:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be >= 2 and epoch non-empty")
        assert self.runner is not None
        tp = self.runner.tp
        if (request.rank, max(1, request.world_size)) != (tp.rank, tp.size):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rank/world_size {request.rank}/{request.world_size} do not match this worker's shard "
                f"(--rank {tp.rank}, --tensor-parallel-size {tp.size})",
            )
        if tp.size > 1 and not request.dist_init_addr:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "dist_init_addr is required when world_size > 1")
        await asyncio.get_running_loop().run_in_executor(self.pool, self._init_cache, request)
        self.queued_steps = 0
        log.info("KV cache ready", blocks=request.num_blocks, rank=request.rank, world_size=request.world_size)
        return worker_pb2.InitCacheResponse()

    def _init_cache(self, request: worker_pb2.InitCacheRequest) -> None:
        runner = self.runner
        assert runner is not None
        # NOTE: a new epoch (a new scheduler, or recovery after a failed step) restarts sequence ids: forget every
        # sequence of the previous one, including any row a failed step left half-added.
        runner.reset()
        if runner.tp.size > 1:
            # NOTE: every epoch re-forms the group (a peer may have restarted) and starts a fresh cache
            form_group(runner.tp, request.dist_init_addr, runner.device, request.epoch)
            self.num_blocks = 0
        if request.num_blocks != self.num_blocks:
            runner.init_kv_cache(request.num_blocks)
            self.num_blocks = request.num_blocks
        self.epoch = request.epoch
        self.rank = request.rank
        self.next_step = 0

    async def Execute(
        self, request: worker_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ExecuteResponse:
        self.last_step_at = time.monotonic()
        self.executing += 1
        try:
            await self._wait_turn(request)
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._execute, request)
        except StepError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:
            log.exception("step failed", step=request.step)
            await context.abort(grpc.StatusCode.INTERNAL, f"step {request.step} failed: {e}")
        finally:
            self.executing -= 1
            self.last_step_at = time.monotonic()

    async def release_when_idle(self, idle_s: float = IDLE_RELEASE_S) -> None:
        """Runs for the server's life: once no step has arrived or run for `idle_s`, the runner gives the heap room
        its steps left free back to the kernel (`ModelRunner.release_idle_heap`), on the step thread, so never
        during a step.

        NOTE: why: `retain_freed_memory` keeps every freed activation in the heap, and `HeapRelease.after_step`
        releases only after a phase of large steps; what the decode steps since then freed stayed resident while the
        worker idled. The scheduler sends no step while it has nothing to run, so silence is how a worker learns that
        a burst is over (`LLM.generate` knows: its call returns). One check per `idle_s`; one release per idle period
        (`HeapRelease` remembers whether a step ran since the last one)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(idle_s)
            runner = self.runner
            if runner is None or self.executing or time.monotonic() - self.last_step_at < idle_s:
                continue
            await loop.run_in_executor(self.pool, runner.release_idle_heap)

    async def _wait_turn(self, request: worker_pb2.ExecuteRequest) -> None:
        """Holds a step of this epoch until every earlier one is queued; the queue (one thread) keeps the order.

        NOTE: the scheduler sends step N+1 after step N, but two calls on one channel may still reach the handlers
        in either order. A step that waits in vain is queued anyway and refused as out of sequence by `_execute`.
        """
        if request.epoch != self.epoch:
            return  # refused by `_execute`
        async with self._order:
            if request.step > self.queued_steps:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._order.wait_for(lambda: request.step <= self.queued_steps), ORDER_WAIT_S
                    )
            self.queued_steps = max(self.queued_steps, request.step + 1)
            self._order.notify_all()

    def _execute(self, request: worker_pb2.ExecuteRequest) -> worker_pb2.ExecuteResponse:
        t0 = time.perf_counter()
        if self.runner is None or not self.epoch:
            raise StepError("the KV cache is not initialized (call InitCache)")
        if request.epoch != self.epoch:
            raise StepError(f"cache epoch {request.epoch!r} is not this worker's ({self.epoch!r}): re-initialize")
        if request.step != self.next_step:
            raise StepError(f"expected step {self.next_step}, got {request.step}: re-initialize")
        plan = plan_from_proto(request)
        self.next_step += 1
        try:
            out = self.runner.execute(plan)
        except Exception:
            self.epoch = ""  # NOTE: the persistent batch may be half-updated: refuse steps until re-initialized
            if self.runner.tp.size > 1:
                leave_group()  # NOTE: the peers' collectives of this step fail at once instead of waiting on this rank
            raise
        resp = result_to_proto(out) if request.return_samples else worker_pb2.ExecuteResponse()
        end = time.perf_counter()
        resp.execute_s = end - t0
        compiles, self._compiles = self._compiles, []  # NOTE: a swap: the compile thread may append meanwhile
        if self.metrics is not None:
            self.metrics.observe_step(
                resp.execute_s,
                len(request.scheduled_seq_ids),
                plan.total_num_scheduled_tokens,
                self.runner.last_timings.collective_s,
            )
            for event in compiles:
                self.metrics.observe_grammar(event)
        if self.telemetry is not None and request.trace.traceparent:
            record_execute(self.telemetry.tracer, request, self.runner.last_timings, self.rank, end, compiles)
        return resp


async def serve(config: WorkerConfig, telemetry: Telemetry | None = None) -> None:
    # NOTE: no tracing interceptor: only steps the scheduler traced carry a context (see services/worker/tracing.py).
    server = grpc.aio.server(options=SERVER_OPTIONS)
    registry = service_registry()
    metrics = WorkerMetrics(registry, model_name(config.engine.model), config.rank, config.engine.tensor_parallel_size)
    serve_metrics(config.host, config.metrics_port, registry, config.tls)
    servicer = WorkerServicer(config, metrics, telemetry)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = ServiceHealth(server, [WORKER_SERVICE])
    await health.set_serving(False)
    port = add_port(server, f"{config.host}:{config.port}", config.tls, require_client_cert=True)
    await server.start()
    log.info("worker listening", addr=f"{config.host}:{port}")
    stop = shutdown_event()
    loading = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(servicer.pool, servicer.load))
    await asyncio.wait([loading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        loading.result()  # NOTE: a failed load raises here and the process exits non-zero
        await health.set_serving(True)
        log.info("worker ready", model=model_name(config.engine.model))
        idle = asyncio.ensure_future(servicer.release_when_idle())
        await stop.wait()
        idle.cancel()
    log.info("draining: steps are served until the scheduler goes quiet")
    await health.start_draining()
    deadline = time.monotonic() + config.drain_timeout
    while time.monotonic() < deadline and time.monotonic() - servicer.last_step_at < config.drain_idle:
        await asyncio.sleep(0.1)
    await server.stop(grace=1.0)
    servicer.pool.shutdown(wait=False, cancel_futures=True)
    log.info("worker stopped")


def main(argv: list[str] | None = None) -> int:
    configure_logging("worker")
    retain_freed_memory()  # NOTE: before the step thread's first allocation (the model load): see host_allocator.py
    config = parse_worker_args(argv)
    telemetry = setup_tracing(config.tracing)
    try:
        asyncio.run(serve(config, telemetry))
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # NOTE: after the drain: the last steps' spans are flushed
    ignore_late_signals()
    return 0
