"""Where served throughput goes: the worker's steps and every thread's CPU during the 64-stream load, against the
same workload offline.

Serving: `pagoda serve` (as side_by_side.py starts it) gets the 64 random requests as 64 OpenAI streams; the
worker's step metrics (`pagoda:worker_step_duration_seconds`, `pagoda:worker_step_tokens`) and the CPU time and
context switches of each thread of each process (/proc) are read before and after, and the worker's RSS when the load
ends and `--idle-s` later. Offline (`--offline`): `LLM.generate` on the same workload in this process, its runner's
steps timed. Both print steps, the tokens they computed, the steps' summed time and the wall time between them.

    python benchmarks/served_steps.py --dtype bfloat16             # served
    python benchmarks/served_steps.py --dtype bfloat16 --offline   # the same steps offline
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import side_by_side as sbs
from openai_load import OpenAIBackend
from processes import Child, _label
from serving import run_concurrency, summarize
from workload import Workload, make

STEP_METRICS = ("worker_step_duration_seconds_sum", "worker_step_duration_seconds_count", "worker_step_tokens_sum")
MIB = 1 << 20


@dataclass
class ThreadCpu:
    role: str
    name: str
    cpu_s: float
    voluntary: int
    involuntary: int


def thread_cpu(pids: list[int]) -> dict[int, ThreadCpu]:
    """Per thread id: CPU seconds (user + system) and context switches, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, ThreadCpu] = {}
    for pid in pids:
        try:
            role = _label(psutil.Process(pid))
            for task in Path(f"/proc/{pid}/task").iterdir():
                stat = (task / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
                out[int(task.name)] = ThreadCpu(
                    role,
                    stat[stat.index("(") + 1 : stat.rindex(")")],
                    (int(fields[11]) + int(fields[12])) / tick,
                    int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"]),
                )
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
    return out


def by_process(before: dict[int, ThreadCpu], after: dict[int, ThreadCpu], field: str) -> dict[str, float]:
    """`field`'s growth between the two samples, summed per process ("cpu_s"; "voluntary": a thread went to sleep,
    one wake-up each)."""
    roles: dict[str, float] = {}
    for tid, t in after.items():
        b = before.get(tid, ThreadCpu(t.role, t.name, 0.0, 0, 0))
        roles[t.role] = roles.get(t.role, 0) + getattr(t, field) - getattr(b, field)
    return roles


def print_threads(before: dict[int, ThreadCpu], after: dict[int, ThreadCpu], min_cpu_s: float = 0.05) -> None:
    for tid, t in after.items():
        b = before.get(tid, ThreadCpu(t.role, t.name, 0.0, 0, 0))
        cpu = t.cpu_s - b.cpu_s
        if cpu >= min_cpu_s and (min_cpu_s > 0 or t.voluntary != b.voluntary):
            print(f"  {t.role:20s} {t.name:14s} cpu {cpu:7.2f} s  switches: voluntary {t.voluntary - b.voluntary:6d}"
                  f"  involuntary {t.involuntary - b.involuntary:6d}")  # fmt: skip
    print("  CPU s by process:", {k: round(v, 2) for k, v in by_process(before, after, "cpu_s").items()})
    print("  wake-ups by process:", by_process(before, after, "voluntary"))


def step_metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name = line.split("{")[0].removeprefix("pagoda:")
        if name in STEP_METRICS:
            out[name] = float(line.split()[-1])
    return out


def report(mode: str, wl: Workload, wall: float, steps: float, step_s: float, tokens: float) -> None:
    print(f"{mode}: {(wl.prompt_tokens + wl.output_tokens) / wall:.1f} total tok/s, wall {wall:.2f} s, {steps:.0f} "
          f"steps of {tokens:.0f} tokens, steps {step_s:.2f} s, between steps {wall - step_s:.2f} s")  # fmt: skip


async def served(args: argparse.Namespace, wl: Workload) -> None:
    from engine_core.checkpoint.model_files import model_name

    h = argparse.Namespace(threads=2, kv_cache_gib=2.0, timeout=900.0, vllm_venv="", peer_model_dir="", model=None)
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--metrics-port", str(args.metrics_port)]
    cmd, url, _ = sbs.server_cmd("pagoda", extra, h, logs, args.dtype, args.quantization)
    _, env = sbs.engine_env("pagoda", h)
    child = Child("serve", cmd, env, str(sbs.REPO), logs)
    backend = OpenAIBackend("pagoda", url, model_name(None))
    try:
        await backend.wait_ready(lambda: child.proc.poll() is None, 900)
        await run_concurrency(backend, make("random", 2, seed=12345).prompts, 2, [8, 8], 120)
        await asyncio.sleep(1.0)
        root = psutil.Process(child.proc.pid)
        pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
        worker = next(p for p in root.children(recursive=True) if "services.worker" in p.cmdline())
        m0, t0, me0 = step_metrics(args.metrics_port + 1), thread_cpu(pids), sum(psutil.Process().cpu_times()[:2])
        records, wall = await run_concurrency(backend, wl.prompts, len(wl.prompts), wl.output_lens, 900)
        m1, t1, me1 = step_metrics(args.metrics_port + 1), thread_cpu(pids), sum(psutil.Process().cpu_times()[:2])
        rss_end = worker.memory_info().rss
        await asyncio.sleep(args.idle_s)
        rss_idle, t2 = worker.memory_info().rss, thread_cpu(pids)
        level = summarize("pagoda", f"c={len(wl.prompts)}", records, wall)
        assert level.output_tokens == wl.output_tokens, level.output_tokens
        d = {k: m1[k] - m0.get(k, 0.0) for k in STEP_METRICS}
        report("served", wl, wall, d[STEP_METRICS[1]], d[STEP_METRICS[0]], d[STEP_METRICS[2]])
        print_threads(t0, t1)
        print(f"  benchmark client CPU {me1 - me0:.2f} s; worker RSS {rss_end / MIB:.0f} MiB when the load ended, "
              f"{rss_idle / MIB:.0f} MiB {args.idle_s:g} s later")  # fmt: skip
        # NOTE: what a process spends per second with no request (health checks, the KV-event watch, gRPC's
        # pollers) grows a load's CPU with its wall; on a shared machine the walls differ several-fold, so the load's
        # own CPU is the process's less that rate times the wall.
        idle = by_process(t1, t2, "cpu_s")
        load = by_process(t0, t1, "cpu_s")
        net = {k: round(v - idle.get(k, 0.0) / args.idle_s * wall, 2) for k, v in load.items()}
        print(f"  idle CPU s per second: { {k: round(v / args.idle_s, 4) for k, v in idle.items()} }")
        if args.idle_threads:
            print(f"  idle, {args.idle_s:g} s:")
            print_threads(t1, t2, min_cpu_s=0.0)
        woke = by_process(t1, t2, "voluntary")
        print(f"  idle wake-ups per second: { {k: round(v / args.idle_s, 1) for k, v in woke.items()} }")
        print(f"  CPU s by process less the idle rate x wall: {net}")
    finally:
        await backend.close()
        child.stop()


def offline(args: argparse.Namespace, wl: Workload) -> None:
    from engine_core import LLM, SamplingParams
    from engine_core.plan import ModelRunnerOutput, SchedulerOutput

    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(None, dtype=args.dtype, quantization=quantization, kv_cache_memory=2.0, num_threads=2)

    def generate(w: Workload) -> None:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
        llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)

    generate(make("random", 2, seed=12345))
    runner = llm.engine.runner
    execute = runner.execute
    totals = [0, 0.0, 0]  # steps, seconds, tokens

    def timed(plan: SchedulerOutput) -> ModelRunnerOutput:
        t = time.perf_counter()
        out = execute(plan)
        if not plan.is_empty:
            totals[0] += 1
            totals[1] += time.perf_counter() - t
            totals[2] += plan.total_num_scheduled_tokens
        return out

    runner.execute = timed
    pids = [os.getpid()]
    t0, w0 = thread_cpu(pids), time.perf_counter()
    generate(wl)
    wall, t1 = time.perf_counter() - w0, thread_cpu(pids)
    report("offline", wl, wall, totals[0], totals[1], totals[2])
    print_threads(t0, t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--offline", action="store_true", help="LLM.generate in this process instead of pagoda serve")
    ap.add_argument("--metrics-port", type=int, default=29500, help="the scheduler's; the worker's is the next one")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds after the load to read the worker's RSS again")
    ap.add_argument("--log-dir", default="/tmp/pagoda-served-steps")
    ap.add_argument("--num-requests", type=int, default=64, help="streams of the load (fewer: a shorter load)")
    ap.add_argument("--idle-threads", action="store_true", help="print each thread's CPU and wake-ups while idle")
    args = ap.parse_args()
    wl = make("random", args.num_requests, seed=0)
    if args.offline:
        offline(args, wl)
    else:
        asyncio.run(served(args, wl))


if __name__ == "__main__":
    main()
