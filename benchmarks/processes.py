"""Child processes of the side-by-side harness: spawned with their own environment, their peak memory sampled, and
stopped (with every descendant: vLLM runs its engine core in a second process) by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

import psutil


class PeakRss:
    """Samples the resident memory of a process and all its descendants (summed: what `top` shows a user) until
    stopped; `peak_gb` is the largest sum seen."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.wait(self.interval):
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        continue
            except psutil.NoSuchProcess:
                return
            self.peak_bytes = max(self.peak_bytes, total)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.peak_bytes / 1e9


class Child:
    """One engine process (offline run or server) with its log file, spawn time and memory sampler."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: str, log_dir: Path) -> None:
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.spawned_at = time.time()
        # NOTE: a process group of its own, so stopping it reaches its descendants and nothing else.
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self._log, stderr=self._log, start_new_session=True)
        self.rss = PeakRss(self.proc.pid)
        self.peak_rss_gb = 0.0

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.peak_rss_gb = self.rss.stop()

    def stop(self, timeout: float = 60.0) -> float:
        """SIGTERM to the child (it drains), SIGKILL to its process group after `timeout`; returns peak RSS in GB."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):  # leftovers of the group (vLLM's engine core, Pagoda's services)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.peak_rss_gb = self.rss.stop()
        self._log.close()
        return self.peak_rss_gb

    def tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])
