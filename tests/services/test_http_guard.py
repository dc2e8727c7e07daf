"""Slow and greedy HTTP clients, with real sockets on loopback against the frontend's HTTP server: a request head or
body that does not arrive in time closes its connection (408) while other clients are served; a source address
over its connection cap is refused; ambiguous body framing is refused."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import pytest

from engine_core.io.tokenizer import Tokenizer
from services.frontend.http_guard import ConnectionCounts, HttpConnectionLimits
from tests.services.http_frontend import get, http_frontend

TIMEOUT = 1.0
CLOSED_WITHIN = 20.0  # generous: the machine is shared; the point is "closed", not how fast
PER_CLIENT = 3
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"


@pytest.fixture(scope="module")
def timeouts_port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(TIMEOUT, TIMEOUT, 0, 0)) as port:
        yield port


@pytest.fixture(scope="module")
def capped_port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(60.0, 60.0, PER_CLIENT, 0)) as port:
        yield port


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _dribble_until_closed(sock: socket.socket, first: bytes, drip: bytes) -> bytes:
    """Sends `first`, then one `drip` every 0.2 s until the server closes; returns what the server answered."""
    sock.sendall(first)
    answer = b""
    deadline = time.monotonic() + CLOSED_WITHIN
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.2)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return answer
            if not chunk:
                return answer
            answer += chunk
            continue
        try:
            sock.sendall(drip)
        except (BrokenPipeError, ConnectionResetError):
            return answer
    raise AssertionError(f"the connection was still open after {CLOSED_WITHIN} s (answered {answer!r})")


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(CLOSED_WITHIN)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except ConnectionResetError:
        pass
    except TimeoutError as e:
        raise AssertionError(f"the connection was still open after {CLOSED_WITHIN} s (answered {answer!r})") from e
    return answer


def test_slow_head_and_slow_body_are_cut_off_while_others_are_served(timeouts_port: int) -> None:
    slow_head, slow_body = _connect(timeouts_port), _connect(timeouts_port)
    slow_head.sendall(HEAD)
    slow_body.sendall(HEAD + b"content-length: 1000\r\n\r\n{")
    assert get(timeouts_port, "/v1/models") == 200  # others are served meanwhile
    with slow_head, slow_body:
        head_answer = _dribble_until_closed(slow_head, b"", b"x")  # a header line that never ends
        body_answer = _dribble_until_closed(slow_body, b"", b" ")  # a body that never completes
    assert head_answer.startswith(b"HTTP/1.1 408"), head_answer
    assert b"head did not arrive" in head_answer
    assert body_answer.startswith(b"HTTP/1.1 408"), body_answer
    assert b"body did not arrive" in body_answer
    assert get(timeouts_port, "/v1/models") == 200


def test_a_connection_that_sends_nothing_is_closed(timeouts_port: int) -> None:
    with _connect(timeouts_port) as idle:
        assert _read_until_closed(idle).startswith(b"HTTP/1.1 408")


def test_keep_alive_requests_each_get_their_own_head_deadline(timeouts_port: int) -> None:
    """A pause between two requests on one connection longer than the head timeout (but within uvicorn's keep-alive
    timeout) is not a slow head: the second request's clock starts at its first byte."""
    request = b"GET /v1/models HTTP/1.1\r\nhost: test\r\n\r\n"
    with _connect(timeouts_port) as conn:
        for _ in range(2):
            conn.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = conn.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer
            time.sleep(TIMEOUT * 1.5)


def test_connections_over_the_per_client_cap_are_refused(capped_port: int) -> None:
    held = [_connect(capped_port) for _ in range(PER_CLIENT)]
    try:
        time.sleep(0.5)  # NOTE: let the server accept them (an accept order, not a timing assertion)
        with _connect(capped_port) as extra:
            answer = _read_until_closed(extra)
        # NOTE: the refusal is written at once; a reset may discard it, but the connection must end either way
        assert answer == b"" or answer.startswith(b"HTTP/1.1 429"), answer
    finally:
        held[0].close()
    deadline = time.monotonic() + CLOSED_WITHIN
    while True:  # the freed place is counted once the server has seen the close
        try:
            assert get(capped_port, "/v1/models") == 200
            break
        except (ConnectionError, OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    for sock in held[1:]:
        sock.close()


def test_transfer_encoding_with_content_length_is_refused(timeouts_port: int) -> None:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with _connect(timeouts_port) as conn:
        conn.sendall(HEAD + b"transfer-encoding: chunked\r\ncontent-length: %d\r\n\r\n" % len(chunked) + chunked)
        answer = _read_until_closed(conn)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"Transfer-Encoding and Content-Length" in answer


def test_connection_counts_cap_each_address_and_the_total_and_forget_closed_ones() -> None:
    limits = HttpConnectionLimits(1.0, 1.0, max_connections_per_client=2, max_connections=3)
    counts = ConnectionCounts()
    assert counts.refusal("a", limits) is None and counts.refusal("a", limits) is None
    refused = counts.refusal("a", limits)
    assert refused is not None and refused[0] == 429
    assert counts.refusal("b", limits) is None
    refused = counts.refusal("c", limits)
    assert refused is not None and refused[0] == 503  # the total is full, whoever asks
    counts.release("a")
    assert counts.refusal("c", limits) is None
    for client in ("a", "b", "c"):
        counts.release(client)
    assert counts.total == 0 and counts.per_client == {}  # no entry per address ever seen
