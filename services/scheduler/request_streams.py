"""Where a request's outputs go: its own `Submit` call, or its tag on a frontend's shared `Stream` call.

`RequestStream` is one admitted request as the scheduler's event loop sees it; `StreamConnection` is one `Stream`
call (a frontend), which sends all of its requests' messages of one event-loop iteration (one engine step's
outputs, admissions, refusals) as one `StreamResponse`.
"""

from __future__ import annotations

import asyncio

import structlog
from opentelemetry.trace import Span

from engine_core.core.request import Request
from services.common.timeutil import monotonic_to_ns
from services.convert.outputs import seq_output_to_proto
from services.rpc import common_pb2, scheduler_pb2
from services.scheduler.request_events import RequestEvent, RequestTimes

log = structlog.get_logger(__name__)

# NOTE: the gRPC message limit is 64 MiB (grpc_opts); one request's message stays under it as on `Submit`, and a
# `StreamResponse` is cut after ~4 MiB so that many requests' large outputs (prompt logprobs, a finished beam
# search) never add up past it.
STREAM_RESPONSE_BYTES = 4 << 20
# Below this many new tokens and without logprobs a message is a few bytes: counted as this, not measured.
_SMALL_TOKENS = 256
_SMALL_BYTES = 64


class RequestStream:
    """One admitted request: where its messages go, the timestamps the frontend sent, and (tracing on) its span."""

    def __init__(
        self,
        request: Request,
        timestamps: common_pb2.RequestTimestamps,
        trace: common_pb2.TraceContext,
        owner: str,
        span: Span | None,
        conn: StreamConnection | None = None,
        tag: int = 0,
    ) -> None:
        self.request = request  # NOTE: events and commands match by this object, so a reused id never mixes
        # `Submit`: its call's outbox. `Stream`: its connection and tag there (the queue stays unused).
        self.queue: asyncio.Queue[scheduler_pb2.SubmitResponse] | None = asyncio.Queue() if conn is None else None
        self.conn = conn
        self.tag = tag
        self.timestamps = timestamps
        self.trace = trace
        self.owner = owner  # the tenant that submitted it: its request ids are scoped by it
        self.span = span
        self.sent_times: RequestTimes = (None, None, None)  # the times its messages carried so far

    def send(self, event: RequestEvent) -> bool:
        """Queues the event's message where this request's messages go. False: it could not be built, and the
        request's message is its failure (INTERNAL) instead; the caller aborts it."""
        conn = self.conn
        entry = None  # its entry in the connection's response being gathered
        try:
            if conn is not None:
                # NOTE: built in place in the connection's response, large ones (logprobs, 256+ tokens) too: only
                # those are measured, and moved (copied) only when they end up past the response's byte bound.
                entry = conn.add(self.tag)
                fill_response(entry, self, event)
                if not is_small(event):
                    conn.measure_last()
                return True
            msg = scheduler_pb2.SubmitResponse()
            fill_response(msg, self, event)
        except Exception as e:
            log.exception("could not convert an event", request_id=event.request_id)
            failed = scheduler_pb2.SubmitResponse(finished=True, error=f"bad output: {e}", error_code="INTERNAL")
            if entry is not None:  # NOTE: replaces the half-built entry: the request reads its failure only
                entry.Clear()
                entry.MergeFrom(failed)
                entry.tag = self.tag
            else:
                self._put(failed)
            return False
        self._put(msg)
        return True

    def _put(self, msg: scheduler_pb2.SubmitResponse) -> None:
        if self.conn is not None:
            self.conn.send(self.tag, msg)
        else:
            assert self.queue is not None
            self.queue.put_nowait(msg)


def fill_response(msg: scheduler_pb2.SubmitResponse, stream: RequestStream, event: RequestEvent) -> None:
    """One step's message of a request, built into `msg`."""
    add = msg.outputs.add
    for o in event.outputs:
        seq_output_to_proto(o, add())
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


def is_small(event: RequestEvent) -> bool:
    """True when the event's message is certainly a few bytes (no logprobs, few tokens): its size is not measured."""
    return all(
        o.new_logprobs is None and o.prompt_logprobs is None and len(o.new_token_ids) < _SMALL_TOKENS
        for o in event.outputs
    )


class StreamConnection:
    """One `Stream` call: its requests by tag and its outbox of `StreamResponse`s.

    NOTE: `add` appends to the response being gathered and flushes it once per event-loop iteration (call_soon), so
    one engine step's outputs of all of this frontend's requests, dispatched in one callback, leave as one message:
    one gRPC write here and one read on the frontend instead of one per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.requests: dict[int, RequestStream] = {}
        self.outbox: asyncio.Queue[scheduler_pb2.StreamResponse | None] = asyncio.Queue()
        self.closing = False  # the frontend half-closed: the call ends once its last request ended
        self._pending: scheduler_pb2.StreamResponse | None = None
        self._pending_bytes = 0

    def add(self, tag: int, size: int = _SMALL_BYTES) -> scheduler_pb2.SubmitResponse:
        """A new message for request `tag` in the response being gathered (`size`: its bytes, when known)."""
        if self._pending is None or self._pending_bytes + size > STREAM_RESPONSE_BYTES:
            if self._pending is None:
                self.loop.call_soon(self.flush)
            else:
                self.outbox.put_nowait(self._pending)
            self._pending, self._pending_bytes = scheduler_pb2.StreamResponse(), 0
        self._pending_bytes += size
        msg = self._pending.responses.add()
        msg.tag = tag
        return msg

    def measure_last(self) -> None:
        """Counts the message last added at its size, once built in place. When that takes the response past
        STREAM_RESPONSE_BYTES, the response leaves without it and it opens the next one."""
        pending = self._pending
        assert pending is not None
        msg = pending.responses[-1]
        size = msg.ByteSize()
        self._pending_bytes += size - _SMALL_BYTES
        if self._pending_bytes <= STREAM_RESPONSE_BYTES or len(pending.responses) == 1:
            return
        moved = scheduler_pb2.StreamResponse()
        moved.responses.add().CopyFrom(msg)
        del pending.responses[-1]
        self.outbox.put_nowait(pending)
        self._pending, self._pending_bytes = moved, size

    def send(self, tag: int, msg: scheduler_pb2.SubmitResponse) -> None:
        """An already built message for request `tag`."""
        self.add(tag, msg.ByteSize()).MergeFrom(msg)

    def flush(self) -> None:
        """Sends the response gathered; after the frontend half-closed and its last request ended, ends the call."""
        if self._pending is not None:
            self.outbox.put_nowait(self._pending)
            self._pending = None
        if self.closing and not self.requests:
            self.outbox.put_nowait(None)
