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


def _label(p: psutil.Process) -> str:
    """A process's role: the module of `python -m MODULE`, else its name (vLLM titles its engine core)."""
    cmd = p.cmdline()
    if "-m" in cmd and cmd.index("-m") + 1 < len(cmd):
        return cmd[cmd.index("-m") + 1]
    return p.name()


class PeakRss:
    """Samples a process and all its descendants until stopped: `peak_gb` is the largest sum of resident memory
    seen (what `top` shows a user), `cpu_s` the CPU seconds (user + system) of each process, by role, as last seen
    (a per-process count of work, meaningful even on a shared machine)."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_bytes = 0
        self.peak_by_role: dict[str, int] = {}  # each role's largest resident memory (summed over its processes)
        self._cpu: dict[int, tuple[str, float]] = {}
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
            by_role: dict[str, int] = {}
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    with p.oneshot():
                        rss = p.memory_info().rss
                        total += rss
                        t = p.cpu_times()
                        label = self._cpu[p.pid][0] if p.pid in self._cpu else _label(p)
                        by_role[label] = by_role.get(label, 0) + rss
                        self._cpu[p.pid] = (label, t.user + t.system)
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)
            for label, rss in by_role.items():
                self.peak_by_role[label] = max(self.peak_by_role.get(label, 0), rss)

    @property
    def peak_gb_by_role(self) -> dict[str, float]:
        return {label: round(b / 1e9, 3) for label, b in sorted(self.peak_by_role.items())}

    @property
    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for label, seconds in self._cpu.values():
            out[label] = out.get(label, 0.0) + seconds
        return out

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
