"""The frontend's one `Stream` call to a scheduler, carrying all of its requests (protos/scheduler.proto).

`SchedulerStream.submit` sends a request under a new tag and returns its `StreamCall`, which reads like a `Submit`
call: the request's `SubmitResponse`s in order, then EOF, or an `AioRpcError` with the status `Submit` would have
ended with (a refusal at admission, a failed worker). One reader task takes each `StreamResponse` apart into the
calls' own queues, so a request whose client reads slowly holds only its own messages: it never stalls the others
on the shared call. What one request holds is bounded by its own outputs (`max_tokens` per choice) and by
`--stream-send-timeout`, after which its client is cut off and the request cancelled (slow_clients.py).

NOTE: the call opens with the first request and again with the first request after it broke. When it breaks (the
scheduler died or restarted, the connection dropped), every request on it fails with UNAVAILABLE: one the scheduler
had not admitted yet is retried on another replica by the router, as a refused `Submit` was.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from services.rpc import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger(__name__)


def _status(code: str, details: str) -> grpc.aio.AioRpcError:
    status = getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class StreamCall:
    """One request on the shared call: `read()` (or `async for`) its messages; `cancel()` aborts it."""

    def __init__(self, stream: SchedulerStream, tag: int) -> None:
        self._stream = stream
        self.tag = tag
        self._queue: asyncio.Queue[scheduler_pb2.SubmitResponse | grpc.aio.AioRpcError] = asyncio.Queue()
        self._done = False  # its last message (or its error) was read, or it was cancelled

    def deliver(self, item: scheduler_pb2.SubmitResponse | grpc.aio.AioRpcError) -> None:
        self._queue.put_nowait(item)

    async def read(self) -> scheduler_pb2.SubmitResponse | object:
        """The next message; `grpc.aio.EOF` after the last; raises the request's error status."""
        if self._done:
            return grpc.aio.EOF
        item = await self._queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> scheduler_pb2.SubmitResponse:
        msg = await self.read()
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        assert isinstance(msg, scheduler_pb2.SubmitResponse)
        return msg

    def cancel(self) -> bool:
        """Aborts the request on the scheduler (its blocks are freed); False when it had already ended."""
        if self._done:
            return False
        self._done = True
        return self._stream.cancel(self.tag)


class SchedulerStream:
    """The `Stream` call on one channel and the requests on it, by tag."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._stub = stub
        self._calls: dict[int, StreamCall] = {}
        self._outbox: asyncio.Queue[scheduler_pb2.StreamRequest | None] | None = None
        self._reader: asyncio.Future[None] | None = None
        self._next_tag = 0

    def submit(self, request: scheduler_pb2.SubmitRequest) -> StreamCall:
        if self._outbox is None:
            self._open()
        assert self._outbox is not None
        self._next_tag += 1
        request.tag = self._next_tag
        call = self._calls[request.tag] = StreamCall(self, request.tag)
        self._outbox.put_nowait(scheduler_pb2.StreamRequest(submit=request))
        return call

    def cancel(self, tag: int) -> bool:
        call = self._calls.pop(tag, None)
        if call is None or self._outbox is None:
            return False
        self._outbox.put_nowait(scheduler_pb2.StreamRequest(cancel=tag))
        return True

    def _open(self) -> None:
        outbox: asyncio.Queue[scheduler_pb2.StreamRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[scheduler_pb2.StreamRequest]:
            while (message := await outbox.get()) is not None:
                yield message

        self._outbox = outbox
        self._reader = asyncio.ensure_future(self._read(self._stub.Stream(requests()), outbox))

    async def _read(
        self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[scheduler_pb2.StreamRequest | None]
    ) -> None:
        error = _status("UNAVAILABLE", "the scheduler ended the stream")
        try:
            async for response in call:
                calls = self._calls
                for msg in response.responses:
                    target = calls.get(msg.tag)
                    if target is None:
                        continue  # NOTE: cancelled here; the scheduler's last messages of it cross the cancel
                    if msg.finished:
                        del calls[msg.tag]
                        if msg.error_code:
                            # NOTE: as `Submit` ended: the status alone (its outputs are dropped), not OK + error.
                            target.deliver(_status(msg.error_code, msg.error))
                            continue
                    target.deliver(msg)
        except grpc.aio.AioRpcError as e:
            error = _status("UNAVAILABLE", f"the stream to the scheduler broke: {e.code().name}: {e.details()}")
            log.warning("scheduler stream broke", code=e.code().name, error=e.details(), in_flight=len(self._calls))
        finally:
            # NOTE: synchronous from here to the reset: no request can join this dead call after its requests failed.
            if self._outbox is outbox:
                self._outbox = None
                self._reader = None
            # NOTE: ends the request iterator: gRPC cancels its consumer task only when the call is cancelled, so
            # on a call the scheduler ended it would wait on this outbox forever.
            outbox.put_nowait(None)
            calls, self._calls = self._calls, {}
            for target in calls.values():
                target.deliver(error)

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
