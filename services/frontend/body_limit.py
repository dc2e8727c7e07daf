"""ASGI middleware for HTTP request bodies: ambiguous framing gets 400, bodies larger than `--max-request-bytes` get
413, before anything parses them."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name for name, _ in scope.get("headers", ())}
        if b"transfer-encoding" in names and b"content-length" in names:
            # NOTE: the request-smuggling shape (RFC 9112 6.3: a proxy and this server may disagree on where the body
            # ends): refused, and the connection closed, rather than guessing.
            await self._reject(send, 400, "a request must not have both Transfer-Encoding and Content-Length", True)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send, 413, self._too_large)
                return
        # NOTE: chunked bodies have no Content-Length: count what arrives; past the limit answer 413 here and tell
        # the app the client left (FastAPI would turn an exception while reading into its own 400).
        seen = 0
        started = rejected = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if not started and not rejected:
                        await self._reject(send, 413, self._too_large)
                    rejected = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 is already out
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception:
            if not rejected:
                raise

    @property
    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes"

    async def _reject(self, send: Send, status: int, message: str, close: bool = False) -> None:
        error: dict[str, Any] = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
