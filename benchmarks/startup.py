"""`pagoda serve` start-up: seconds from spawning it (its defaults, free loopback ports) to the first 1-token
completion answered, as side_by_side.py times it, the worker's `model loaded` seconds, and each service's peak RSS
(VmHWM) at that point.

`--evict` first drops the model's weight file from the page cache (POSIX_FADV_DONTNEED), as on a node that has not
read it yet; how much that costs depends on the disk (docs/benchmarks.md, "Start-up", throttles it with a cgroup).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/startup.py [--rounds 3] [--evict] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import psutil
from openai_load import OpenAIBackend
from processes import Child

REPO = Path(__file__).resolve().parents[1]


def evict(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def model_load_seconds(log_dir: Path) -> float | None:
    for line in (log_dir / "worker0.log").read_text().splitlines():
        if '"model loaded"' in line:
            return float(json.loads(line)["seconds"])
    return None


SERVICES = ("frontend", "scheduler", "worker")


def peak_rss_mb(pid: int) -> dict[str, int]:
    """Each service's peak RSS (VmHWM, MB) among the processes under `pid`, by the module it runs."""
    peaks: dict[str, int] = {}
    for proc in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except (psutil.Error, OSError):
            continue
        name = next((s for s in SERVICES if f"services.{s}" in cmd or f" {s} " in f" {cmd} "), None)
        hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        if name is not None:
            peaks[name] = max(peaks.get(name, 0), hwm // 1000)
    return peaks


async def start_once(args: argparse.Namespace, logs: Path, rnd: int) -> tuple[float, float | None, dict[str, int]]:
    from engine_core.checkpoint.model_files import model_name
    from services.launcher import free_port

    http, serve_logs = free_port(), logs / f"serve-{rnd}"
    cmd = [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http)]
    cmd += ["--grpc-port", str(free_port()), "--scheduler-port", str(free_port()), "--worker-port", str(free_port())]
    cmd += ["--log-dir", str(serve_logs)] + (["--model", args.model] if args.model else [])
    child = Child(f"serve-{rnd}", cmd, dict(os.environ), str(REPO), logs)
    backend = OpenAIBackend("pagoda", f"http://127.0.0.1:{http}", model_name(args.model))
    try:
        ready = await backend.wait_ready(lambda: child.proc.poll() is None, args.timeout)
        peaks = peak_rss_mb(child.proc.pid)
    finally:
        await backend.close()
        child.stop(timeout=30)
    return ready - child.spawned_at, model_load_seconds(serve_logs), peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--evict", action="store_true", help="drop the weight file from the page cache before each start")
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: the default model)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    from engine_core.checkpoint.model_dir import weight_files
    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import EngineConfig

    files = [f.resolve() for f in weight_files(resolve_model_dir(args.model, EngineConfig().cache_dir))]
    logs = Path(tempfile.mkdtemp(prefix="pagoda-startup-"))
    print(f"weights: {', '.join(map(str, files))} ({sum(f.stat().st_size for f in files) / 1e6:.0f} MB); logs {logs}")
    starts = []
    for rnd in range(1, args.rounds + 1):
        if args.evict:
            evict(files)
        seconds, load, peaks = asyncio.run(start_once(args, logs, rnd))
        starts.append(seconds)
        print(f"round {rnd}: ready after {seconds:.2f} s (worker: model loaded in {load} s); peak RSS MB {peaks}")
    print(f"median {statistics.median(starts):.2f} s over {len(starts)} starts{' (weights evicted)' * args.evict}")


if __name__ == "__main__":
    main()
