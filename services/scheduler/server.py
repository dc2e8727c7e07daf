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
from opentelemetry.trace import Span, Status, StatusCode
from prometheus_client import CollectorRegistry

from engine_core.core.kv_events import KvEvent
from engine_core.core.request import Request
from services.common.grpc_opts import SERVER_OPTIONS
from services.common.health import ServiceHealth
from services.common.logs import configure_logging
from services.common.metrics import EngineStatsCollector, serve_metrics, service_registry
from services.common.request_scope import check_tenant, scoped_request_id
from services.common.signals import ignore_late_signals, shutdown_event
from services.common.telemetry import Telemetry, setup_tracing
from services.common.timeutil import now_ns
from services.common.tls import add_port
from services.common.trace import TraceContext
from services.rpc import SCHEDULER_SERVICE, common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.admission import Refused, engine_request
from services.scheduler.config import SchedulerConfig, parse_scheduler_args
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.kv_event_hub import KvEventHub
from services.scheduler.kv_event_stream import watch_kv_events
from services.scheduler.request_events import RequestEvent
from services.scheduler.request_streams import RequestStream, StreamConnection
from services.scheduler.stats_messages import kv_load, stats_response
from services.scheduler.tracing import record_request, request_span

log = structlog.get_logger(__name__)

# Why a `Stream` request's span ends in error when it was aborted (a `Submit` span's CANCELLED is the interceptor's).
CALL_ENDED = "cancelled: the frontend's Stream call ended"
CANCELLED = "cancelled by the frontend"

_STATUS = {
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


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
        self.streams: dict[str, RequestStream] = {}
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
            conn = stream.conn
            if not stream.send(event):  # NOTE: one request's bad output fails that request alone
                self._end(stream, abort=True)
                continue
            if conn is not None and event.finished:
                self._end(stream, abort=False, error=event.error if event.error_code else "")

    def _end(self, stream: RequestStream, abort: bool, error: str = "") -> None:
        """A request leaves the scheduler's streams: finished, failed, or its caller went away (`abort`: then its
        blocks are freed now). Its span, when it has its own (`Stream`), ends here."""
        rid = stream.request.request_id
        if self.streams.get(rid) is stream:
            del self.streams[rid]
        if abort:
            self.engine.abort(stream.request)
        conn = stream.conn
        if conn is None:
            return  # NOTE: `Submit`'s span is its call's (the interceptor ends it)
        if conn.requests.get(stream.tag) is stream:
            del conn.requests[stream.tag]
        if stream.span is not None:
            if not abort and self.telemetry is not None:
                record_request(self.telemetry.tracer, stream.span, stream.request)
            if error:
                stream.span.set_status(Status(StatusCode.ERROR, error))
            stream.span.end()
        if conn.closing and not conn.requests:
            self.loop.call_soon(conn.flush)

    # ---- RPCs ---------------------------------------------------------------------------------------------------
    def _admit(self, request: scheduler_pb2.SubmitRequest) -> Request:
        """The engine request of a valid submission; raises Refused (its status names the field) otherwise."""
        if self.draining or not self.ready or self.engine.info is None:
            why = "draining" if self.draining else "not ready (workers loading)"
            raise Refused("UNAVAILABLE", f"scheduler is {why}")
        info = self.engine.info
        rid = request.request_id
        if not rid:
            raise Refused("INVALID_ARGUMENT", "request_id must not be empty")
        try:
            check_tenant(request.owner)
        except ValueError as e:
            raise Refused("INVALID_ARGUMENT", str(e)) from e
        scoped = scoped_request_id(request.owner, rid)
        if scoped in self.streams:
            raise Refused("ALREADY_EXISTS", f"request_id {rid!r} is already in use")
        if len(self.streams) >= self.config.max_num_seqs + self.config.max_waiting_requests:
            raise Refused(
                "RESOURCE_EXHAUSTED", f"scheduler queue is full ({len(self.streams)} requests in flight): retry later"
            )
        core = self.engine.core
        if core is None:  # stopped between the readiness check and here
            raise Refused("UNAVAILABLE", "scheduler is stopping")
        return engine_request(request, scoped, info.vocab_size, core)

    def _start(
        self,
        request: scheduler_pb2.SubmitRequest,
        engine_request: Request,
        span: Span | None,
        conn: StreamConnection | None = None,
    ) -> scheduler_pb2.SubmitResponse:
        """Queues an admitted request; returns its first message (empty: "admitted")."""
        ts = common_pb2.RequestTimestamps()
        ts.CopyFrom(request.timestamps)
        ts.queued_ns = now_ns()
        if span is not None:
            # NOTE: the request's server span becomes its context, which the step spans link to and the worker
            # receives.
            tc = TraceContext.of_span(span)
            if tc.traceparent:
                engine_request.trace_context = tc.as_dict()
        stream = RequestStream(engine_request, ts, request.trace, request.owner, span, conn, request.tag)
        self.streams[engine_request.request_id] = stream
        if conn is not None:
            conn.requests[request.tag] = stream
        self.engine.add(engine_request)
        # NOTE: an empty first message says "admitted": the frontend can answer HTTP 200 (or fail with 429/503
        # before any byte of the stream) without waiting for the first token.
        return scheduler_pb2.SubmitResponse(trace=request.trace, timestamps=ts)

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        try:
            engine_request = self._admit(request)
        except Refused as e:
            await context.abort(_STATUS[e.code], e.message)
        rid = engine_request.request_id  # scoped: tenant/request_id
        # NOTE: the interceptor's server span (child of the frontend's call) is current here.
        span = otel_trace.get_current_span() if self.telemetry is not None else None
        admitted = self._start(request, engine_request, span)
        stream = self.streams[rid]
        assert stream.queue is not None
        finished = False
        try:
            yield admitted
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
            # NOTE: not finished: the caller cancelled (or its frontend died): its blocks are freed now.
            self._end(stream, abort=not finished)

    async def Stream(
        self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.StreamResponse]:
        conn = StreamConnection(self.loop)
        reader = asyncio.ensure_future(self._read_stream(conn, request_iterator))
        try:
            while (response := await conn.outbox.get()) is not None:
                yield response
        finally:
            reader.cancel()
            # NOTE: the frontend went away (or closed): every request it still had is aborted, its blocks freed.
            for stream in list(conn.requests.values()):
                self._end(stream, abort=True, error=CALL_ENDED)
            # NOTE: waited for (asyncio.wait never raises), so that a failure of the frontend's request stream (a
            # message that does not parse, say) is logged here with the call, not as "exception never retrieved".
            await asyncio.wait([reader])
            if not reader.cancelled() and (error := reader.exception()) is not None:
                log.error("a frontend's request stream failed", error=repr(error))

    async def _read_stream(
        self, conn: StreamConnection, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest]
    ) -> None:
        try:
            async for message in request_iterator:
                if message.HasField("submit"):
                    self._open(conn, message.submit)
                else:
                    stream = conn.requests.get(message.cancel)
                    if stream is not None:
                        self._end(stream, abort=True, error=CANCELLED)
        finally:
            conn.closing = True
            conn.flush()

    def _open(self, conn: StreamConnection, request: scheduler_pb2.SubmitRequest) -> None:
        """One submission on a `Stream`: admitted, or refused with its status (one request never fails another)."""
        try:
            running = conn.requests.get(request.tag)
            if running is not None:
                # NOTE: the caller lost track of its tags: the tag's request ends too (aborted), so both sides agree
                # that the tag is free after this one refusal.
                self._end(running, abort=True)
                raise Refused("INVALID_ARGUMENT", f"tag {request.tag} is already in use on this stream")
            engine_request = self._admit(request)
            span = None
            if self.telemetry is not None:
                # NOTE: the request's own server span, named as `Submit`'s: its parent is the frontend's call span
                # (SubmitRequest.trace), so a request stays one trace across the three processes.
                span = request_span(self.telemetry.tracer, TraceContext.from_proto(request.trace))
            conn.send(request.tag, self._start(request, engine_request, span, conn))
        except Refused as e:
            conn.send(request.tag, scheduler_pb2.SubmitResponse(finished=True, error=e.message, error_code=e.code))
        except Exception as e:  # NOTE: a bug in one submission fails that request alone, not the stream
            log.exception("could not admit a request", request_id=request.request_id)
            conn.send(request.tag, scheduler_pb2.SubmitResponse(finished=True, error=str(e), error_code="INTERNAL"))

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
        return stats_response(self.engine.stats, self.draining)

    async def WatchKvEvents(
        self, request: scheduler_pb2.WatchKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.KvEventBatch]:
        async for batch in watch_kv_events(self.kv_events, request.from_seq, request.stream_id, self._load, context):
            yield batch

    def _load(self) -> scheduler_pb2.KvLoad:
        return kv_load(self.engine.stats.engine)

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
