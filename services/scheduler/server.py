"""The scheduler process: the Scheduler gRPC service in front of the engine loop.

It holds all request state (block tables, prefix cache, queues), so frontends are stateless: any number of them
can submit here, and one that restarts only loses its own streams (their cancellation aborts their requests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from opentelemetry import trace as otel_trace
from opentelemetry.trace import Span
from prometheus_client import CollectorRegistry

from engine_core.core.kv_events import KvEvent
from engine_core.core.prompt_checks import check_token_ids
from engine_core.core.request import Request
from services.common.grpc_opts import SERVER_OPTIONS
from services.common.health import ServiceHealth
from services.common.logs import configure_logging
from services.common.metrics import EngineStatsCollector, serve_metrics, service_registry
from services.common.request_scope import check_tenant, scoped_request_id
from services.common.signals import ignore_late_signals, shutdown_event
from services.common.telemetry import Telemetry, setup_tracing
from services.common.timeutil import monotonic_to_ns, now_ns
from services.common.tls import add_port
from services.common.trace import TraceContext
from services.convert.outputs import seq_output_to_proto
from services.convert.params import params_from_proto
from services.convert.ranges import check_wire_ranges
from services.rpc import SCHEDULER_SERVICE, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.config import SchedulerConfig, parse_scheduler_args
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.kv_event_hub import KvEventHub
from services.scheduler.kv_event_stream import watch_kv_events
from services.scheduler.request_events import RequestEvent, RequestTimes
from services.scheduler.tracing import record_request

log = structlog.get_logger(__name__)

_STATUS = {
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
}


class _Stream:
    """One Submit call: its outbox, the timestamps the frontend sent, and (tracing on) its server span."""

    def __init__(
        self,
        request: Request,
        timestamps: common_pb2.RequestTimestamps,
        trace: common_pb2.TraceContext,
        owner: str,
        span: Span | None,
    ) -> None:
        self.request = request  # NOTE: events and commands match by this object, so a reused id never mixes
        self.queue: asyncio.Queue[scheduler_pb2.SubmitResponse] = asyncio.Queue()
        self.timestamps = timestamps
        self.trace = trace
        self.owner = owner  # the tenant that submitted it: its request ids are scoped by it
        self.span = span
        self.sent_times: RequestTimes = (None, None, None)  # the times its messages carried so far


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        config: SchedulerConfig,
        health: ServiceHealth,
        telemetry: Telemetry | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.health = health
        self.telemetry = telemetry
        self.loop = asyncio.get_running_loop()
        self.kv_events = KvEventHub()
        self.engine = EngineLoop(
            config,
            self._publish_threadsafe,
            self._on_ready_threadsafe,
            telemetry,
            registry,
            self._publish_kv_threadsafe,
        )
        # NOTE: keyed by the scoped id (tenant/request_id), which is also the engine's request id: two tenants'
        # equal ids are two requests, and an id never answers for another tenant's request.
        self.streams: dict[str, _Stream] = {}
        self.ready = False
        self.draining = False
        self.failed = asyncio.Event()
        self._tasks: set[asyncio.Future[None]] = set()

    # ---- engine thread -> event loop -------------------------------------------------------------------------
    def _publish_threadsafe(self, events: list[RequestEvent]) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, events)

    def _publish_kv_threadsafe(self, events: list[KvEvent]) -> None:
        self.loop.call_soon_threadsafe(self._publish_kv, events)

    def _publish_kv(self, events: list[KvEvent]) -> None:
        info = self.engine.info
        if info is not None:
            self.kv_events.block_size = info.block_size  # NOTE: known before the first block is stored
        self.kv_events.publish(events)

    def _on_ready_threadsafe(self, ready: bool) -> None:
        self.loop.call_soon_threadsafe(self._set_ready, ready)

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        if self.engine.fatal is not None:
            self.failed.set()
        if not self.draining:
            task = asyncio.ensure_future(self.health.set_serving(ready))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _dispatch(self, events: list[RequestEvent]) -> None:
        for event in events:
            stream = self.streams.get(event.request_id)
            if stream is None or (event.request is not None and event.request is not stream.request):
                continue  # the caller went away (its abort is already queued), or a stale event of a reused id
            try:
                stream.queue.put_nowait(self._message(stream, event))
            except Exception as e:  # NOTE: one request's bad output fails that request alone
                log.exception("could not convert an event", request_id=event.request_id)
                stream.queue.put_nowait(
                    scheduler_pb2.SubmitResponse(finished=True, error=f"bad output: {e}", error_code="INTERNAL")
                )
                self.engine.abort(stream.request)

    @staticmethod
    def _message(stream: _Stream, event: RequestEvent) -> scheduler_pb2.SubmitResponse:
        msg = scheduler_pb2.SubmitResponse(outputs=[seq_output_to_proto(o) for o in event.outputs])
        if event.finished:
            msg.finished = True
            msg.trace.CopyFrom(stream.trace)
        if event.error:
            msg.error, msg.error_code = event.error, event.error_code
        # NOTE: the timestamps only on the messages where a time changed (~3 per request), not on every token's
        # message (building and serializing a token's message: 4.7 -> 3.1 µs; docs/benchmarks.md).
        if event.times != stream.sent_times or event.finished:
            stream.sent_times = event.times
            ts = msg.timestamps
            ts.CopyFrom(stream.timestamps)
            ts.scheduled_ns, ts.first_token_ns, ts.finished_ns = (monotonic_to_ns(t) for t in event.times)
        return msg

    # ---- RPCs ---------------------------------------------------------------------------------------------------
    async def _validate(self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext) -> Request:
        if self.draining or not self.ready or self.engine.info is None:
            why = "draining" if self.draining else "not ready (workers loading)"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"scheduler is {why}")
        info = self.engine.info
        assert info is not None
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:
            check_tenant(request.owner)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        scoped = scoped_request_id(request.owner, rid)
        if scoped in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use")
        if len(self.streams) >= self.config.max_num_seqs + self.config.max_waiting_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"scheduler queue is full ({len(self.streams)} requests in flight): retry later",
            )
        core = self.engine.core
        if core is None:  # stopped between the readiness check and here
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is stopping")
        assert core is not None
        try:
            params = params_from_proto(request.sampling, internal=True)
            params.validate_vocab(info.vocab_size)
            check_wire_ranges(params)  # NOTE: seed + n - 1 must fit the step message's int64
            check_token_ids(request.prompt_token_ids, info.vocab_size)
            # NOTE: the engine's own admission limits (frozen RequestLimits, so safe from this thread), checked here
            # so a bad request fails its RPC instead of failing later on the engine thread.
            core.check_request(len(request.prompt_token_ids), params.n)
            if params.use_beam_search:
                width = params.n if params.beam_width is None else params.beam_width
                core.limits.check_beam(len(request.prompt_token_ids), width, params.max_tokens)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return Request(
            request_id=scoped,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params,
            priority=request.priority,
            cache_salt=request.cache_salt or None,
            trace_context=TraceContext.from_proto(request.trace).as_dict(),
        )

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        engine_request = await self._validate(request, context)
        rid = engine_request.request_id  # scoped: tenant/request_id
        ts = common_pb2.RequestTimestamps()
        ts.CopyFrom(request.timestamps)
        ts.queued_ns = now_ns()
        span = None
        if self.telemetry is not None:
            # NOTE: the interceptor's server span (child of the frontend's call) is current here; it becomes the
            # request's context, which the step spans link to and the worker receives.
            span = otel_trace.get_current_span()
            tc = TraceContext.of_span(span)
            if tc.traceparent:
                engine_request.trace_context = tc.as_dict()
        stream = self.streams[rid] = _Stream(engine_request, ts, request.trace, request.owner, span)
        self.engine.add(engine_request)
        finished = False
        try:
            # NOTE: an empty first message says "admitted": the frontend can answer HTTP 200 (or fail with 429/503
            # before any byte of the stream) without waiting for the first token.
            yield scheduler_pb2.SubmitResponse(trace=request.trace, timestamps=ts)
            while not finished:
                msg = await stream.queue.get()
                finished = msg.finished
                if finished and span is not None and self.telemetry is not None:
                    # NOTE: before the last message: the interceptor ends the span when the stream ends.
                    record_request(self.telemetry.tracer, span, engine_request)
                if finished and msg.error_code:
                    # NOTE: a failed request ends with its status (UNAVAILABLE: retry; INTERNAL), not OK + error.
                    await context.abort(_STATUS.get(msg.error_code, grpc.StatusCode.INTERNAL), msg.error)
                yield msg
        finally:
            if self.streams.get(rid) is stream:
                del self.streams[rid]
            if not finished:
                # NOTE: the caller cancelled (or its frontend died): free the request's blocks now.
                self.engine.abort(engine_request)

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        # NOTE: looked up in the caller's scope: another tenant's request is an unknown id (nothing is revealed).
        stream = self.streams.get(scoped_request_id(request.owner, request.request_id))
        if stream is not None:
            self.engine.abort(stream.request)
        return common_pb2.AbortResponse(found=stream is not None)

    async def FinishChoice(
        self, request: scheduler_pb2.FinishChoiceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.FinishChoiceResponse:
        stream = self.streams.get(scoped_request_id(request.owner, request.request_id))
        if stream is not None:
            self.engine.finish_choice(stream.request, request.index, request.stop)
        return scheduler_pb2.FinishChoiceResponse()

    async def Stats(
        self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.StatsResponse:
        return self.stats_response()

    def metrics_snapshot(self) -> scheduler_pb2.StatsResponse | None:
        """What /metrics exports (from the metrics server's thread): nothing until the engine is ready."""
        return self.stats_response() if self.engine.stats.ready else None

    def model_name(self) -> str:
        info = self.engine.info
        return info.model if info is not None else ""

    def stats_response(self) -> scheduler_pb2.StatsResponse:
        """The Stats RPC's answer; also what the scheduler's /metrics reads (from the metrics server's thread)."""
        s = self.engine.stats
        e = s.engine
        return scheduler_pb2.StatsResponse(
            running=e.running,
            waiting=e.waiting,
            num_requests=e.num_requests,
            free_blocks=e.free_blocks,
            total_blocks=e.total_blocks,
            kv_usage=e.kv_usage,
            prefix_cache_hit_rate=e.prefix_cache_hits / e.prefix_cache_queries if e.prefix_cache_queries else 0.0,
            prefix_cache_queries=e.prefix_cache_queries,
            prefix_cache_hits=e.prefix_cache_hits,
            preemptions=e.preemptions,
            prefix_cache_evictions=e.prefix_cache_evictions,
            steps=s.steps,
            draining=self.draining,
            step_seconds=s.step_seconds,
            worker_seconds=s.worker_seconds,
            running_requests=e.running_requests,
            waiting_requests=e.waiting_requests,
            spec_decode_num_drafts=e.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=e.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=e.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(e.spec_decode_num_accepted_tokens_per_pos),
            beam_search_requests=e.beam_search_requests,
            beam_search_beams_forked=e.beam_search_beams_forked,
            beam_search_beams_pruned=e.beam_search_beams_pruned,
            beam_search_live_beams=e.beam_search_live_beams,
        )

    async def WatchKvEvents(
        self, request: scheduler_pb2.WatchKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.KvEventBatch]:
        async for batch in watch_kv_events(self.kv_events, request.from_seq, request.stream_id, self._load, context):
            yield batch

    def _load(self) -> scheduler_pb2.KvLoad:
        e = self.engine.stats.engine
        return scheduler_pb2.KvLoad(
            running=e.running,
            waiting=e.waiting,
            kv_usage=e.kv_usage,
            running_requests=e.running_requests,
            waiting_requests=e.waiting_requests,
            free_blocks=e.free_blocks,
            total_blocks=e.total_blocks,
        )

    async def Info(
        self, request: scheduler_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.InfoResponse:
        info = self.engine.info
        if info is None or not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is not ready (workers loading)")
        assert info is not None
        return scheduler_pb2.InfoResponse(
            model=info.model,
            architecture=info.architecture,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            num_kv_blocks=self.engine.stats.engine.total_blocks,
            max_num_seqs=self.config.max_num_seqs,
            num_workers=len(self.config.worker_addrs),
        )

    async def drain(self, timeout: float) -> None:
        """Stops admitting, lets every in-flight stream finish (up to `timeout`), then stops the engine."""
        self.draining = True
        await self.health.start_draining()
        deadline = time.monotonic() + timeout
        if self.streams:
            log.info("draining", in_flight=len(self.streams))
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.streams:
            log.warning("drain timed out: aborting", in_flight=len(self.streams))
            for stream in list(self.streams.values()):
                self.engine.abort(stream.request)
            await asyncio.sleep(0.5)
        await asyncio.to_thread(self.engine.stop)


async def serve(config: SchedulerConfig, telemetry: Telemetry | None = None) -> int:
    server = grpc.aio.server(
        options=SERVER_OPTIONS, interceptors=telemetry.server_interceptors() if telemetry is not None else None
    )
    health = ServiceHealth(server, [SCHEDULER_SERVICE])
    await health.set_serving(False)
    registry = service_registry()
    servicer = SchedulerServicer(config, health, telemetry, registry)
    registry.register(EngineStatsCollector(servicer.metrics_snapshot, servicer.model_name))
    serve_metrics(config.host, config.metrics_port, registry, config.tls)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = add_port(server, f"{config.host}:{config.port}", config.tls, require_client_cert=True)
    await server.start()
    log.info("scheduler listening", addr=f"{config.host}:{port}", workers=config.worker_addrs)
    servicer.engine.start()
    stop = shutdown_event()
    failed = asyncio.ensure_future(servicer.failed.wait())
    await asyncio.wait([asyncio.ensure_future(stop.wait()), failed], return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        log.error("engine failed", error=str(servicer.engine.fatal))
        await server.stop(grace=1.0)
        return 1
    await servicer.drain(config.drain_timeout)
    await server.stop(grace=2.0)
    log.info("scheduler stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging("scheduler")
    config = parse_scheduler_args(argv)
    telemetry = setup_tracing(config.tracing)
    try:
        code = asyncio.run(serve(config, telemetry))
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # NOTE: after the drain: the last requests' spans are flushed
    ignore_late_signals()
    return code
