"""The frontend's uvicorn server (services/frontend/http_server.py): it serves with uvicorn's Date header and stops
when `should_exit` is set, without waiting for its next tick."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable

import pytest
import uvicorn

from services.frontend import http_server
from services.frontend.http_server import HttpServer
from services.launcher import free_port

Message = dict[str, object]


async def _app(
    scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_serves_without_a_tick_and_exits_at_once_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: a tick of an hour: were exiting left to the tick, the server would outlive the test's 30 s
    monkeypatch.setattr(http_server, "TICK_S", 3600.0)
    port = free_port()
    ticks: list[int] = []

    async def run() -> tuple[int, str | None, bool]:
        server = HttpServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        on_tick = server.on_tick

        async def counted(counter: int) -> bool:
            ticks.append(counter)
            return await on_tick(counter)

        server.on_tick = counted
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.02)

        def get() -> tuple[int, str | None]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
                return resp.status, resp.headers.get("date")

        status, date = await asyncio.to_thread(get)
        await asyncio.sleep(0.5)  # uvicorn's own loop would tick ~5 more times here
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        return status, date, server.should_exit

    status, date, exited = asyncio.run(run())
    assert status == 200 and date is not None and date.endswith("GMT")
    assert exited
    assert ticks == [0, 10], "one tick at the start (the Date header) and one when told to exit, none between"
