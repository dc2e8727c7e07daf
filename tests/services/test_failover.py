"""Failover beyond the single-worker fault tests (test_faults.py): `pagoda serve` itself restarts a SIGKILLed worker
and the stream it held resumes. (With two ranks, killing and restarting rank 1 re-forms the group:
tests/services/test_tensor_parallel.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.common.health import SERVING, check
from services.launcher import free_port
from services.rpc import GENERATION_SERVICE, generation_pb2
from tests.services.probes import all_blocks_free, print_logs, wait_until

pytestmark = pytest.mark.slow

REQUEST = text_request(
    "Tell me a long story about a lighthouse keeper and the sea. " * 8, max_tokens=96, ignore_eos=True
)


class Stream:
    """One stream read on a thread: its tokens (choice 0) and how it ended."""

    def __init__(self, client: GenerationClient, request: generation_pb2.GenerateRequest) -> None:
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, request), daemon=True)
        self._thread.start()

    def _run(self, client: GenerationClient, request: generation_pb2.GenerateRequest) -> None:
        try:
            for msg in client.stream(request):
                for c in msg.choices:
                    self.tokens.extend(c.token_ids)
                if len(self.tokens) >= 8:
                    self.started.set()
        except grpc.RpcError as e:
            self.error = e
        self.started.set()

    def result(self, timeout: float) -> list[int]:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return self.tokens


def children(pid: int, module: str) -> list[int]:
    """The direct children of `pid` that run `python -m module`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and module.encode() in argv:
            found.append(int(entry.name))
    return found


def test_pagoda_serve_restarts_a_sigkilled_worker_and_its_stream_resumes(tmp_path: Path, smollm2_dir: str) -> None:
    grpc_port, scheduler_port, worker_port = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port)]
    argv += [
        "--http-port",
        str(free_port()),
        "--scheduler-port",
        str(scheduler_port),
        "--worker-port",
        str(worker_port),
    ]
    argv += ["--metrics-port", "-1", "--dtype", "float32", "--kv-cache-memory", "0.25", "--worker-threads", "1"]
    argv += ["--log-dir", str(tmp_path)]
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen(argv, stdout=log, stderr=log)
    addr = f"127.0.0.1:{grpc_port}"
    try:
        wait_until(lambda: check(addr, GENERATION_SERVICE) == SERVING, 600, "pagoda serve SERVING")
        with GenerationClient(addr) as client:
            expected = Stream(client, REQUEST).result(300)
            stream = Stream(client, REQUEST)
            assert stream.started.wait(120)
            (worker,) = children(serve.pid, "services.worker")
            subprocess.run(["kill", "-9", str(worker)], check=True)
            assert stream.result(300) == expected  # resumed on the restarted worker, no token lost or repeated
        restarted = children(serve.pid, "services.worker")
        assert len(restarted) == 1 and restarted != [worker]
        assert serve.poll() is None
        wait_until(lambda: all_blocks_free(f"127.0.0.1:{scheduler_port}"), 30, "every block free")
        assert "process restarted" in (tmp_path / "serve.log").read_text()
        scheduler_log = (tmp_path / "scheduler.log").read_text()
        assert '"worker group re-formed"' in scheduler_log and '"streams resumed"' in scheduler_log
    except Exception:
        print_logs(tmp_path)
        raise
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)
