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


async def send_within(send: Awaitable[None], timeout: float, request_id: str) -> None:
    """Awaits one send; RequestError(RESOURCE_EXHAUSTED) when the client has not taken it within `timeout`."""
    try:
        # NOTE: asyncio.timeout, not wait_for: no extra task per message (Python 3.11's wait_for wraps one).
        async with asyncio.timeout(timeout):
            await send
    except TimeoutError as e:
        error = stalled(timeout)
        log.warning("client stopped reading: its request is aborted", request_id=request_id, error=error.message)
        raise error from e


class SseResponse(StreamingResponse):
    """An SSE stream whose every chunk must be taken within `send_timeout`; a client that stops reading longer has
    its request(s) aborted at once and its connection closed."""

    def __init__(self, content: object, send_timeout: float, request_id: str) -> None:
        super().__init__(content, media_type="text/event-stream")  # type: ignore[arg-type]
        self.send_timeout = send_timeout
        self.request_id = request_id

    async def stream_response(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        timeout = self.send_timeout
        sending_since: float | None = None  # when the send in progress began; None between sends

        async def send_in_time(message: Message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            try:
                await send(message)
            finally:
                sending_since = None

        # NOTE: one timer per stream, re-armed only when it fires (at most once per `timeout`), instead of a timer
        # armed and cancelled around every chunk: that was ~8 % of the frontend's CPU at 64 streams. When it finds
        # a send older than `timeout` it expires the scope, which cancels this task inside that send.
        scope = asyncio.timeout(None)
        try:
            async with scope:

                def check() -> None:
                    nonlocal timer
                    now = loop.time()
                    if sending_since is not None and now - sending_since >= timeout:
                        scope.reschedule(now)
                    else:
                        timer = loop.call_at((now if sending_since is None else sending_since) + timeout, check)

                timer = loop.call_later(timeout, check)
                try:
                    await super().stream_response(send_in_time)
                finally:
                    timer.cancel()
        except TimeoutError:
            if not scope.expired():
                raise
            error = stalled(timeout)
            log.warning(
                "client stopped reading: its request is aborted", request_id=self.request_id, error=error.message
            )
            # NOTE: closing the chunks aborts the request(s) now; uvicorn then closes the connection (the response
            # stays unfinished: an error event could not reach a client that reads nothing).
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
