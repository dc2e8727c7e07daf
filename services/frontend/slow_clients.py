"""Clients that stop reading: every message of a stream must be taken by the client within `--stream-send-timeout`.

A stream's messages are sent one at a time, and a send returns once the transport took the message: gRPC when
the client's HTTP/2 window and gRPC's write buffer have room, the HTTP API when uvicorn's write buffer is
under its high-water mark (64 KiB). So what the frontend holds for one stream is bounded by those buffers plus the
one message being sent; while a send waits, the stream reads nothing more from the scheduler.

NOTE: a client whose send has waited `--stream-send-timeout` seconds is ended, not paused. Its request is aborted at
once (its KV blocks, batch slots and frontend slot are freed: they are what other clients wait for) and the stream
ends with RESOURCE_EXHAUSTED (gRPC; HTTP 429 in an SSE error event where one still fits). Pausing instead would hold
the KV blocks for a client that may never come back, and preempting would recompute its whole context when it does;
a client that is slow but reading (a send completes within the timeout) is never cut, however slow. This is the
`send_timeout` of nginx and the stream idle timeout of Envoy, applied per message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from types import TracebackType

import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from services.frontend.request import ErrorCode, RequestError

log = structlog.get_logger(__name__)

DEFAULT_STREAM_SEND_TIMEOUT = 30.0


def stalled(timeout: float) -> RequestError:
    return RequestError(
        ErrorCode.RESOURCE_EXHAUSTED,
        f"the client did not read the stream for {timeout:g} s (--stream-send-timeout): the request was aborted",
    )


class SendWatchdog:
    """`--stream-send-timeout` for every send of one stream (`async with` around the sends, each through `send`): a
    send still waiting `timeout` seconds after it began cancels it and the block raises RequestError
    (RESOURCE_EXHAUSTED).

    NOTE: one timer per stream, re-armed only when it fires (at most once per `timeout`), instead of a timer armed
    and cancelled around every message (4.4 against 0.35 µs a send: docs/benchmarks.md). The timer only
    expires the scope while a send is in progress, so the cancellation lands in that send."""

    def __init__(self, timeout: float, request_id: str) -> None:
        self.timeout = timeout
        self.request_id = request_id
        self._loop = asyncio.get_running_loop()
        self._scope = asyncio.timeout(None)
        self._sending_since: float | None = None  # when the send in progress began; None between sends
        self._timer: asyncio.TimerHandle | None = None

    async def send(self, send: Awaitable[None]) -> None:
        self._sending_since = self._loop.time()
        try:
            await send
        finally:
            self._sending_since = None

    def _check(self) -> None:
        now = self._loop.time()
        since = self._sending_since
        if since is not None and now - since >= self.timeout:
            self._scope.reschedule(now)
        else:
            self._timer = self._loop.call_at((now if since is None else since) + self.timeout, self._check)

    async def __aenter__(self) -> SendWatchdog:
        await self._scope.__aenter__()
        self._timer = self._loop.call_later(self.timeout, self._check)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            await self._scope.__aexit__(exc_type, exc, tb)
        except TimeoutError as e:
            if not self._scope.expired():
                raise
            error = stalled(self.timeout)
            log.warning(
                "client stopped reading: its request is aborted", request_id=self.request_id, error=error.message
            )
            raise error from e


class SseResponse(StreamingResponse):
    """An SSE stream whose every chunk must be taken within `send_timeout`; a client that stops reading longer has
    its request(s) aborted at once and its connection closed."""

    def __init__(self, content: object, send_timeout: float, request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream")  # type: ignore[arg-type]
        self.send_timeout = send_timeout
        self.request_id = request_id

    async def stream_response(self, send: Send) -> None:
        try:
            async with SendWatchdog(self.send_timeout, self.request_id) as watchdog:

                async def send_in_time(message: Message) -> None:
                    await watchdog.send(send(message))

                await super().stream_response(send_in_time)
        except RequestError:
            # NOTE: closing the chunks aborts the request(s) now; uvicorn then closes the connection (the response
            # stays unfinished: an error event could not reach a client that reads nothing).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
