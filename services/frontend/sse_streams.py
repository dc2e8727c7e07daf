"""Server-sent events of the OpenAI API: the `data:` lines, a batch of prompts' streams interleaved, and a stream's
response started only once the request was admitted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import Response
from pydantic import BaseModel

from services.frontend.openai_errors import error_response
from services.frontend.request import RequestError, StreamEvent
from services.frontend.slow_clients import SseResponse


def sse_data(body: BaseModel) -> str:
    return f"data: {body.model_dump_json(exclude_none=False)}\n\n"


async def merge_streams(streams: list[AsyncIterator[StreamEvent]]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """Interleaves the streams of a batch of prompts; closing the merge closes (aborts) every stream."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def start_sse(chunks: AsyncIterator[str], send_timeout: float, request_id: str) -> Response:
    """Reads the stream up to its first chunk before answering, so failures of admission (overload, scheduler or
    worker down) get their status code (429, 503) instead of an error event after a 200. Empty chunks only mark
    that the request was admitted and are not sent. A client that stops reading for `send_timeout` is cut off
    (services.frontend.slow_clients)."""
    try:
        first = await anext(chunks, None)
    except RequestError as e:
        await chunks.aclose()
        return error_response(e)

    async def rest() -> AsyncIterator[str]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                if chunk:
                    yield chunk
        finally:
            await chunks.aclose()  # NOTE: closed early (client gone or too slow): its requests are aborted now

    return SseResponse(rest(), send_timeout, request_id)
