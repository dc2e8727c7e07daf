"""Clients that stop reading (services/frontend/slow_clients.py): what the frontend holds for them stays bounded,
their request is aborted `--stream-send-timeout` seconds after a send stalls (KV pool back to idle), the stream
ends with RESOURCE_EXHAUSTED (gRPC) or a closed connection (SSE), and a neighbour's greedy tokens are unchanged."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.common.health import wait_serving
from services.launcher import LocalCluster, free_port
from services.rpc import GENERATION_SERVICE, generation_pb2, generation_pb2_grpc
from tests.services.probes import all_blocks_free, scheduler_stats, wait_until

pytestmark = pytest.mark.slow

SEND_TIMEOUT_S = 3
MAX_TOKENS = 2000
N = 16
NEIGHBOUR = text_request("The capital of France is", max_tokens=24)


@dataclass(frozen=True)
class SlowFrontend:
    frontend_addr: str
    http_url: str
    scheduler_addr: str


@pytest.fixture(scope="module")
def slow_frontend(cluster: LocalCluster) -> Iterator[SlowFrontend]:
    """A frontend with `--stream-send-timeout` on the session cluster's scheduler and worker (float32: the
    neighbour's greedy tokens do not depend on its batch).
    NOTE: a frontend, not a cluster: the flag is the frontend's alone, so the session's scheduler and worker serve it
    (no second model load, no three more processes to start and stop)."""
    port, http_port = free_port(), free_port()
    args = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", str(http_port)]
    args += ["--scheduler-addr", cluster.scheduler_addr, "--stream-send-timeout", str(SEND_TIMEOUT_S)]
    proc = subprocess.Popen([sys.executable, "-m", "services.frontend", *args])
    try:
        wait_serving(f"127.0.0.1:{port}", GENERATION_SERVICE, timeout=120)
        yield SlowFrontend(f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", cluster.scheduler_addr)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def neighbour_tokens(slow_frontend: SlowFrontend) -> list[int]:
    """The neighbour's greedy tokens when it runs alone."""
    with GenerationClient(slow_frontend.frontend_addr) as client:
        return client.generate(NEIGHBOUR).choices[0].token_ids


def _wait_stalled_then_freed(frontend: SlowFrontend) -> None:
    """The stalled request runs, then is aborted: no request left, every KV block free (the client reads nothing)."""

    def running() -> bool:
        s = scheduler_stats(frontend.scheduler_addr)
        return s is not None and s.running >= N

    # NOTE: first seen running: the scheduler's stats may not show a request admitted a moment ago.
    wait_until(running, 60, "the stalled request running")
    wait_until(lambda: all_blocks_free(frontend.scheduler_addr), 180, "the stalled request's blocks freed")


def _assert_neighbour_unchanged(frontend: SlowFrontend, expected: list[int]) -> None:
    with GenerationClient(frontend.frontend_addr) as client:
        assert client.generate(NEIGHBOUR).choices[0].token_ids == expected


def test_grpc_client_that_stops_reading_is_cut_off(slow_frontend: SlowFrontend, neighbour_tokens: list[int]) -> None:
    request = text_request(
        "Tell me a long story about the sea.",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        n=N,
        logprobs=20,
        ignore_eos=True,
    )
    # NOTE: no BDP probing: the client's receive window stays at HTTP/2's 64 KiB instead of growing to megabytes,
    # so its transport fills in a few steps (what it holds is the client's own memory, not the frontend's).
    with grpc.insecure_channel(slow_frontend.frontend_addr, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request)
        messages = [next(call)]  # admitted; then this client reads nothing
        neighbour = threading.Thread(target=_assert_neighbour_unchanged, args=(slow_frontend, neighbour_tokens))
        neighbour.start()
        _wait_stalled_then_freed(slow_frontend)
        neighbour.join(120)
        assert not neighbour.is_alive()
        with pytest.raises(grpc.RpcError) as info:
            for message in call:  # what was buffered for it (client and frontend together), then the status
                messages.append(message)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--stream-send-timeout" in (info.value.details() or "")
    tokens = sum(len(c.token_ids) for m in messages for c in m.choices)
    assert 0 < tokens < N * MAX_TOKENS // 10, tokens  # bounded: a small part of the stream, never the whole of it
    assert all(isinstance(m, generation_pb2.GenerateResponse) and not m.HasField("final") for m in messages)


def _post_without_reading(url: str, body: dict[str, object]) -> socket.socket:
    """POSTs `body` on a socket with a small receive buffer and reads only the status line."""
    parsed = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # NOTE: before connect: a small TCP window
    # NOTE: and small segments: the frontend's kernel sizes the socket's send buffer by segment size; with loopback's
    # 64 KiB segments ~3 MB (many seconds of 16 streams) go in before uvicorn's send waits, with 1 KiB ones ~130 KB.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
    sock.settimeout(60)
    sock.connect((parsed.hostname, parsed.port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parsed.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    first = sock.recv(256)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock


def test_sse_client_that_stops_reading_is_cut_off(slow_frontend: SlowFrontend, neighbour_tokens: list[int]) -> None:
    body = {
        "prompt": "Tell me a long story about the sea.",
        "max_tokens": MAX_TOKENS,
        "n": N,
        "logprobs": 20,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "stream": True,
    }
    sock = _post_without_reading(slow_frontend.http_url, body)
    with sock:
        neighbour = threading.Thread(target=_assert_neighbour_unchanged, args=(slow_frontend, neighbour_tokens))
        neighbour.start()
        _wait_stalled_then_freed(slow_frontend)
        neighbour.join(120)
        assert not neighbour.is_alive()
        rest = bytearray()
        while chunk := sock.recv(1 << 16):  # what was buffered for it, then the frontend closes the connection
            rest += chunk
    assert b"data: " in rest
    assert b"[DONE]" not in rest  # cut off, not finished
    assert len(rest) < 8 << 20, len(rest)  # bounded
