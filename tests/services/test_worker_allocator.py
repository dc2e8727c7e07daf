"""The worker's allocator: its settings (engine_core/worker/host_allocator.py) precede the model load, and a worker
that no step reaches for a while gives its heap's free room back to the kernel."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import LocalCluster

MIB = 1 << 20


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_worker_keeps_freed_memory_from_before_the_model_load(cluster: LocalCluster) -> None:
    log = Path(cluster.config.log_dir or "") / "worker0.log"
    events = [json.loads(line).get("event") for line in log.read_text().splitlines() if line.startswith("{")]
    # NOTE: the order matters: a thread keeps the arena of its first allocation, and the step thread loads the model
    assert "allocator keeps freed memory" in events and "worker ready" in events
    assert events.index("allocator keeps freed memory") < events.index("worker ready")


# A worker (the servicer on an event loop, the worker's allocator settings, a tiny Llama) runs a request's first
# steps; then, on its step thread, 72 MiB of step-sized temporaries are freed inside the heap (what a burst's decode
# steps leave: the tiny model's own are too small to measure) with a kept tensor allocated after them; then the
# worker's idle watch runs. Prints the RSS before the temporaries, once they are freed, after the first idle
# release, and the release count after each phase: idle without a step since, one more step, idle again.
IDLE_PROBE = """
import asyncio, json, sys, time, torch
from engine_core.worker.host_allocator import retain_freed_memory
assert retain_freed_memory()
from engine_core.config import EngineConfig
from engine_core.core.request import Request
from engine_core.core.scheduler import Scheduler
from engine_core.sampling_params import SamplingParams
from services.convert.plan import plan_to_proto
from services.rpc import worker_pb2
from services.worker import server
from services.worker.config import parse_worker_args

IDLE_S = 0.2
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
config = parse_worker_args(["--model", sys.argv[1], "--num-kv-blocks", "16", "--block-size", "4"])
worker = server.WorkerServicer(config)
sched = Scheduler(EngineConfig(num_kv_blocks=16, block_size=4), 64, 16)
sched.add_request(Request("r", [3, 9, 27, 81], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
plans = [sched.schedule()] + [sched.schedule_ahead() for _ in range(4)]
steps = [plan_to_proto(p, epoch="e1", step=i) for i, p in enumerate(plans)]

def temporaries():
    xs = [torch.empty(12 << 18, dtype=torch.float32).fill_(1.0) for _ in range(6)]
    kept = torch.ones(1 << 14)
    del xs
    return kept

async def until_released(n):
    for _ in range(200):
        if worker.runner.heap_release.releases >= n:
            return
        await asyncio.sleep(0.05)

async def main():
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(worker.pool, worker.load)
    await worker.InitCache(worker_pb2.InitCacheRequest(num_blocks=16, epoch="e1", world_size=1), None)
    for step in steps[:4]:
        await worker.Execute(step, None)
    releases = [worker.runner.heap_release.releases]
    before = rss()
    kept = await loop.run_in_executor(worker.pool, temporaries)
    freed = rss()
    watch = asyncio.ensure_future(worker.release_when_idle(IDLE_S))
    await until_released(1)
    idle = rss()
    releases.append(worker.runner.heap_release.releases)
    await asyncio.sleep(4 * IDLE_S)  # idle on, no step since the release: nothing more to give back
    releases.append(worker.runner.heap_release.releases)
    await worker.Execute(steps[4], None)
    await until_released(2)
    releases.append(worker.runner.heap_release.releases)
    watch.cancel()
    print(json.dumps([before, freed, idle, releases, kept.numel()]))

asyncio.run(main())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_an_idle_worker_gives_its_heaps_free_room_back(tiny_dir: Path) -> None:
    # NOTE: the child inherits PYTHONPATH, as test_host_allocator.py's probes do
    out = subprocess.run([sys.executable, "-c", IDLE_PROBE, str(tiny_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, freed, idle, releases, _ = json.loads(out.stdout.splitlines()[-1])
    assert freed - before > 60 * MIB  # the control: the worker's allocator kept the freed temporaries
    assert idle - before < 8 * MIB
    # none while steps ran (tiny steps never make a large one); one per idle period that followed a step
    assert releases == [0, 1, 1, 2]
