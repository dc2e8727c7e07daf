"""Overload and graceful SIGTERM drain, on an extra frontend attached to the session's scheduler."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.common.health import NOT_SERVING, check, wait_serving
from services.launcher import LocalCluster, free_port
from services.rpc import GENERATION_SERVICE, common_pb2, generation_pb2
from tests.services.probes import scrape

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_stream_in_flight(cluster: LocalCluster) -> None:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    http_port = free_port()
    args = ["--host", "127.0.0.1", "--grpc-port", str(port), "--http-port", str(http_port)]
    args += ["--scheduler-addr", cluster.scheduler_addr, "--max-inflight", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "services.frontend", *args], stderr=subprocess.PIPE)
    try:
        wait_serving(addr, GENERATION_SERVICE, timeout=120)
        with GenerationClient(addr) as client:
            messages: list[generation_pb2.GenerateResponse] = []
            first = threading.Event()

            def consume() -> None:
                for msg in client.stream(text_request("Tell me a story.", max_tokens=40, ignore_eos=True)):
                    messages.append(msg)
                    first.set()

            reader = threading.Thread(target=consume)
            reader.start()
            assert first.wait(60)
            # Overload: this frontend admits one request at a time.
            with pytest.raises(grpc.RpcError) as info:
                list(client.stream(text_request("Hi", max_tokens=2)))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # ...counted by reason on the frontend's /metrics, next to its process metrics.
            page = scrape(f"http://127.0.0.1:{http_port}/metrics")
            rejections = {dict(k)["reason"]: v for k, v in page["pagoda:request_rejections_total"].items()}
            assert rejections == {
                "max_inflight": 1,
                "draining": 0,
                "scheduler_queue_full": 0,
                "scheduler_unavailable": 0,
            }
            assert page["process_resident_memory_bytes"][()] > 0
            proc.send_signal(signal.SIGTERM)
            reader.join(60)
            assert not reader.is_alive()
            final = messages[-1].final
            assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert final.usage.completion_tokens == 40
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The shared services are unaffected.
    assert check(cluster.frontend_addr, GENERATION_SERVICE) != NOT_SERVING
