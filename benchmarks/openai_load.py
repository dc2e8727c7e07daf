"""A streaming `/v1/completions` client for any OpenAI-compatible server, shaped like serving.py's backends.

Token ids go in as the prompt (both Pagoda and vLLM accept a list of ints), greedy, `ignore_eos`, and the usage
block of the last chunk (`stream_options.include_usage`) gives the true completion-token count: a server may hold
back text of an incomplete UTF-8 sequence, so chunks and tokens need not match one to one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp


class OpenAIBackend:
    def __init__(self, name: str, base_url: str, model: str) -> None:
        self.name = name
        self.url = f"{base_url}/v1/completions"
        self.model = model
        # NOTE: no connection cap (aiohttp's default is 100 per host): 64 streams at once must all be in flight.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )

    async def close(self) -> None:
        await self.session.close()

    def _body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
        body: dict[str, object] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        """Yields 1 per chunk that carries text; the usage chunk yields the tokens not yet counted."""
        seen = 0
        async with self.session.post(self.url, json=self._body(prompt, max_tokens, True)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    seen += 1
                    yield 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens", 0) > seen:
                    yield usage["completion_tokens"] - seen
                    seen = usage["completion_tokens"]

    async def wait_ready(self, alive: object, timeout: float) -> float:
        """Sends a 1-token completion until one succeeds (model loaded, every hop up); returns when, as time.time().
        `alive()` is polled so a server that died fails fast."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not alive():  # type: ignore[operator]
                raise RuntimeError(f"{self.name} exited before it was ready")
            try:
                async with self.session.post(
                    self.url, json=self._body([1, 2, 3], 1, False), timeout=aiohttp.ClientTimeout(total=10)
                ) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return time.time()
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s")
