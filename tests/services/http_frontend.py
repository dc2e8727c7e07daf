"""The frontend's real HTTP server (uvicorn with `GuardedConfig`, the OpenAI app, the tokenizer) on loopback, in a
thread, for tests of what happens before a request reaches the scheduler: connections, framing, body parsing and
validation. Its scheduler address has nothing behind it, so a request that passes every check gets 503."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from engine_core.io.tokenizer import Tokenizer
from services.frontend.http_guard import GuardedConfig, HttpConnectionLimits
from services.frontend.openai_api import create_app
from services.frontend.pipeline import AdmissionPolicy, RequestPipeline
from services.frontend.request import ModelDescription
from services.frontend.scheduler_client import SchedulerClient
from services.frontend.tokenization import PromptTokenizer
from services.frontend.tool_calls import ToolSettings

MAX_MODEL_LEN = 2048


@contextmanager
def http_frontend(
    tokenizer: Tokenizer, limits: HttpConnectionLimits, tools: ToolSettings | None = None
) -> Iterator[int]:
    """Serves until the block ends; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    holder: dict[str, Any] = {}
    ready = threading.Event()

    async def main() -> None:
        # NOTE: nothing listens on the discard port: the channel only fails requests that got past every check.
        client = SchedulerClient("127.0.0.1:9")
        vocab = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
        model = ModelDescription("smollm2", "LlamaForCausalLM", MAX_MODEL_LEN, vocab, 16, 64, 2, True)
        pipeline = RequestPipeline(PromptTokenizer(tokenizer, vocab, MAX_MODEL_LEN), client, model, AdmissionPolicy())
        app = create_app(pipeline, lambda: True, tools=tools)
        server = uvicorn.Server(GuardedConfig(app, limits, log_level="warning", lifespan="off", access_log=False))
        holder["server"] = server
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        ready.set()
        await serving
        await client.close()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(60), "the HTTP server did not start"
    try:
        yield port
    finally:
        holder["server"].should_exit = True
        thread.join(30)
        sock.close()


def post_json(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()
