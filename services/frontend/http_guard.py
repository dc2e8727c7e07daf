"""The HTTP API's connections: read timeouts and connection caps, which uvicorn lacks.

uvicorn times out idle keep-alive connections but never a client that sends its request slowly: a connection that
dribbles its headers or its body one byte at a time stays open for ever. `GuardedH11Protocol` (uvicorn's h11
protocol plus a timer) closes a connection whose request head is not complete `header_timeout` seconds after its
first byte (or after the connection opened), or whose body is not complete `body_timeout` seconds after its head,
answering 408 when no response has started. Time spent on the response (a long SSE stream) is never limited.

Connections are counted per source address (the TCP peer, not `X-Forwarded-For`) and in all; one over either cap
is answered 429 / 503 with `Connection: close` at once, before any of its bytes are read.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpConnectionLimits:
    header_timeout: float  # seconds from a request's first byte (or the connection's start) to its last header
    body_timeout: float  # seconds from a request's last header to the end of its body
    max_connections_per_client: int  # open connections from one source address (0: no cap)
    max_connections: int  # open connections in all (0: no cap)


@dataclass
class ConnectionCounts:
    total: int = 0
    per_client: dict[str, int] = field(default_factory=dict)

    def refusal(self, client: str, limits: HttpConnectionLimits) -> tuple[int, str] | None:
        """(status, message) when a new connection from `client` is over a cap; otherwise counts it."""
        if limits.max_connections and self.total >= limits.max_connections:
            return 503, f"the server has {self.total} open connections, its limit: retry later"
        mine = self.per_client.get(client, 0)
        if limits.max_connections_per_client and mine >= limits.max_connections_per_client:
            return 429, f"{mine} connections are open from your address, the limit: reuse them or close some"
        self.total += 1
        self.per_client[client] = mine + 1
        return None

    def release(self, client: str) -> None:
        self.total -= 1
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]  # NOTE: no entry per address ever seen: the map stays bounded


class GuardedConfig(uvicorn.Config):
    """uvicorn's config carrying the limits and the server-wide counts to every connection's protocol."""

    def __init__(self, app: Any, limits: HttpConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, **kwargs)
        self.connection_limits = limits
        self.connection_counts = ConnectionCounts()


def _raw_response(status: int, reason: str, message: str, retry_after: bool) -> bytes:
    kind = {429: "resource_exhausted", 503: "unavailable"}.get(status, "invalid_request_error")  # as the API's own
    error = {"message": message, "type": kind}
    body = json.dumps({"error": {**error, "param": None, "code": status}}).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
    ]
    if retry_after:
        head.append("retry-after: 1")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    config: GuardedConfig

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "head" | "body" while the client owes us bytes under a deadline
        self._peer = self.client[0] if self.client else ""
        refusal = self.config.connection_counts.refusal(self._peer, self.config.connection_limits)
        self._counted = refusal is None
        if refusal is not None:
            status, message = refusal
            reason = "Too Many Requests" if status == 429 else "Service Unavailable"
            transport.write(_raw_response(status, reason, message, retry_after=True))
            transport.close()
            return
        self._expect("head")

    def data_received(self, data: bytes) -> None:
        if self._reading is None and self.conn.their_state is h11.IDLE:
            self._expect("head")  # NOTE: a keep-alive connection's next request: its clock starts at its first byte
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        if self._counted:
            self._counted = False
            self.config.connection_counts.release(self._peer)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Moves the deadline along with what h11 has read of the client's request."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._reading != "body":
                self._expect("body")
        elif state is not h11.IDLE or self.transport.is_closing():
            self._expect(None)  # the request is read (or the connection is going): the response is not limited
        # IDLE: waiting for a head; its deadline (if any bytes came) keeps running

    def _expect(self, what: str | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._reading = what
        if what is not None:
            limits = self.config.connection_limits
            seconds = limits.header_timeout if what == "head" else limits.body_timeout
            self._timer = self.loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        what, self._timer = self._reading, None
        if self.transport.is_closing():
            return
        if self.cycle is None or not self.cycle.response_started:
            limits = self.config.connection_limits
            seconds = limits.header_timeout if what == "head" else limits.body_timeout
            message = f"the request's {what} did not arrive within {seconds:g} s"
            self.transport.write(_raw_response(408, "Request Timeout", message, retry_after=False))
        self.transport.close()  # NOTE: connection_lost then tells the app (its receive() answers http.disconnect)
