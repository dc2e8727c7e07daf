"""The frontend's uvicorn server: signals left to the frontend, and no 10 Hz tick.

uvicorn's `Server.main_loop` wakes every 100 ms to see whether it should exit (and refreshes the Date header every
tenth time). Here it wakes once a second, the Date header's resolution, and at once when `should_exit` is set.
NOTE: why: the frontend shares a 2-core machine with the worker's compute threads, where every wake-up of an idle
process can preempt one of them mid-step (docs/benchmarks.md, "Serving at 64 streams against offline"); a drain
notices `should_exit` as soon as it is set, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

TICK_S = 1.0  # NOTE: uvicorn's on_tick refreshes the Date header every 10th tick: one tick here counts as 10


class HttpServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        self._exit = asyncio.Event()  # NOTE: before uvicorn's __init__, which sets should_exit
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the frontend owns SIGTERM: it drains gRPC and HTTP together, then stops uvicorn itself.
        yield

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._exit.wait()
