"""Serving benchmark: the three gRPC services vs the in-process engine, same workload, same run.

Load: closed loops at fixed concurrency levels, then an open loop with Poisson arrivals; every level is bounded by a
request count and a duration. Requests are random token-id prompts (fixed seed, distinct per request, so the
prefix cache never helps) with a fixed output length (ignore_eos). Per level it reports throughput and TTFT,
time per output token (TPOT), inter-token latency (ITL) and end-to-end latency at p50/p90/p99; writes JSON and a
PNG (latency vs load) to benchmarks/results/.

    python benchmarks/serving.py [--concurrency 1,4,16] [--rate 2] [--num-requests 32] [--max-tokens 32]

Both backends timestamp tokens the same way: when an asyncio client in this process receives them (the services
over loopback gRPC; the in-process engine from its step thread via call_soon_threadsafe).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.io.output_processor import OutputProcessor
from engine_core.llm import load_engine
from engine_core.sampling_params import SamplingParams, with_eos

RESULTS = Path(__file__).parent / "results"


@dataclass
class Record:
    start: float
    token_times: list[float] = field(default_factory=list)  # receipt time of each token

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start

    @property
    def tpot(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


@dataclass
class LevelResult:
    backend: str
    load: str  # "c=4" or "rate=2.0"
    requests: int
    duration_s: float
    output_tokens: int
    throughput_tok_s: float
    throughput_req_s: float
    latency_ms: dict[str, dict[str, float]]  # metric -> {p50, p90, p99, mean}


class Backend(Protocol):
    name: str

    def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        """Yields the number of new tokens per received chunk."""
        ...


class InProcessBackend:
    """EngineCore + OutputProcessor on a step thread, the way an in-process async server would drive it."""

    name = "in-process"

    def __init__(self, config: EngineConfig) -> None:
        self.engine = load_engine(config)
        self.processor = OutputProcessor(self.engine.tokenizer)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pending: list[tuple[Request, asyncio.Queue[int | None]]] = []
        self.queues: dict[str, asyncio.Queue[int | None]] = {}
        self.wake = threading.Condition()
        self.ids = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(10)

    def _run(self) -> None:
        core = self.engine.core
        while True:
            with self.wake:
                while not self.pending and not core.has_unfinished and not self.stopping:
                    self.wake.wait()
                if self.stopping:
                    return
                new, self.pending = self.pending, []
            for request, queue in new:
                core.add_request(request)
                self.processor.add_request(request.request_id, None, request.prompt_token_ids, request.sampling_params)
                self.queues[request.request_id] = queue
            step = self.processor.process(core.step())
            for stop in step.stops:
                core.finish_choice(stop.request_id, stop.index, FinishReason.STOP_STRING, stop.stop)
            for update in step.updates:
                queue = self.queues[update.output.request_id]
                n = sum(len(d.token_ids) for d in update.deltas)
                assert self.loop is not None
                if n:
                    self.loop.call_soon_threadsafe(queue.put_nowait, n)
                if update.output.finished:
                    self.loop.call_soon_threadsafe(queue.put_nowait, None)
                    del self.queues[update.output.request_id]

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        self.ids += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        params = with_eos(params, self.engine.eos_token_id, self.engine.runner.info.vocab_size)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        with self.wake:
            self.pending.append((Request(str(self.ids), list(prompt), params), queue))
            self.wake.notify()
        while (n := await queue.get()) is not None:
            yield n


class ServicesBackend:
    """The public Generation API of a local cluster (frontend -> scheduler -> worker processes)."""

    name = "services"

    def __init__(self, addr: str) -> None:
        import grpc

        from services.rpc import generation_pb2_grpc

        self.channel = grpc.aio.insecure_channel(addr)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        from services.rpc import common_pb2, generation_pb2

        opts = common_pb2.SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=opts)
        async for msg in self.stub.Generate(req):
            n = sum(len(c.token_ids) for c in msg.choices)
            if n:
                yield n


async def _one(backend: Backend, prompt: list[int], max_tokens: int) -> Record:
    rec = Record(time.perf_counter())
    async for n in backend.stream(prompt, max_tokens):
        now = time.perf_counter()
        rec.token_times.extend([now] * n)
    return rec


async def run_concurrency(
    backend: Backend, prompts: list[list[int]], c: int, max_tokens: int | list[int], max_s: float
) -> tuple[list[Record], float]:
    """`c` closed-loop users share the prompts; `max_tokens` is one length for all or one per prompt."""
    lens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    todo = list(zip(prompts, lens, strict=True))
    records: list[Record] = []
    t0 = time.perf_counter()

    async def user() -> None:
        while todo and time.perf_counter() - t0 < max_s:
            prompt, n = todo.pop()
            records.append(await _one(backend, prompt, n))

    await asyncio.gather(*(user() for _ in range(c)))
    return records, time.perf_counter() - t0


async def run_poisson(
    backend: Backend, prompts: list[list[int]], rate: float, max_tokens: int, max_s: float, seed: int
) -> tuple[list[Record], float]:
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    for prompt in prompts:
        if time.perf_counter() - t0 > max_s:
            break
        tasks.append(asyncio.ensure_future(_one(backend, prompt, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - t0


def summarize(backend: str, load: str, records: list[Record], duration: float) -> LevelResult:
    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
        a = np.asarray(values) * 1000
        return {
            "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()),
        }

    tokens = sum(len(r.token_times) for r in records)
    return LevelResult(
        backend=backend,
        load=load,
        requests=len(records),
        duration_s=duration,
        output_tokens=tokens,
        throughput_tok_s=tokens / duration,
        throughput_req_s=len(records) / duration,
        latency_ms={
            "ttft": pct([r.ttft for r in records]),
            "tpot": pct([r.tpot for r in records]),
            "itl": pct([x for r in records for x in r.itls]),
            "e2e": pct([r.e2e for r in records]),
        },
    )


async def bench(backends: list[Backend], args: argparse.Namespace, vocab: int) -> list[LevelResult]:
    """Runs every load level on each backend in turn (interleaved, so a change in background load on a shared
    machine hits both alike); every backend gets the same prompts."""
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(n)]

    # NOTE: a short warm-up so neither backend pays first-call costs (allocator, thread pools) in the numbers.
    for backend in backends:
        await run_concurrency(backend, prompts(2), 2, 4, 60)
    results = []
    for c in args.concurrency:
        level = prompts(args.num_requests)
        for backend in backends:
            records, duration = await run_concurrency(backend, level, c, args.max_tokens, args.max_duration)
            results.append(summarize(backend.name, f"c={c}", records, duration))
            print_level(results[-1])
    if args.rate > 0:
        level = prompts(args.num_requests)
        for backend in backends:
            records, duration = await run_poisson(
                backend, level, args.rate, args.max_tokens, args.max_duration, args.seed
            )
            results.append(summarize(backend.name, f"rate={args.rate:g}", records, duration))
            print_level(results[-1])
    return results


def print_level(r: LevelResult) -> None:
    lat = r.latency_ms
    print(
        f"{r.backend:10s} {r.load:9s} {r.requests:3d} req {r.throughput_tok_s:7.1f} tok/s  "
        f"TTFT p50 {lat['ttft']['p50']:7.1f} p99 {lat['ttft']['p99']:7.1f} ms  "
        f"TPOT p50 {lat['tpot']['p50']:6.1f} ms  ITL p99 {lat['itl']['p99']:6.1f} ms  "
        f"e2e p50 {lat['e2e']['p50']:7.1f} ms",
        flush=True,
    )


def plot(results: list[LevelResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for backend, style, color in (("in-process", "o-", "tab:blue"), ("services", "s--", "tab:green")):
        closed = [r for r in results if r.backend == backend and r.load.startswith("c=")]
        poisson = [r for r in results if r.backend == backend and r.load.startswith("rate=")]
        for ax, metric in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
            x = [r.throughput_tok_s for r in closed]
            ax.plot(x, [r.latency_ms[metric]["p50"] for r in closed], style, color=color, label=f"{backend} p50")
            ax.plot(
                x, [r.latency_ms[metric]["p99"] for r in closed], style, color=color, alpha=0.35, label=f"{backend} p99"
            )
            for r in poisson:  # NOTE: open-loop points, not on the concurrency curve
                ax.plot(r.throughput_tok_s, r.latency_ms[metric]["p50"], "*", color=color, markersize=12)
            for r in closed + poisson:
                ax.annotate(r.load, (r.throughput_tok_s, r.latency_ms[metric]["p50"]), fontsize=7)
            ax.set_xlabel("throughput (output tok/s)")
            ax.set_ylabel(f"{metric.upper()} (ms)")
            ax.set_title(f"{metric.upper()} vs load (stars: Poisson arrivals)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> list[LevelResult]:
    from services.launcher import LaunchConfig, LocalCluster

    config = EngineConfig(
        dtype="float32", kv_cache_memory=args.kv_cache_memory, num_threads=args.threads, max_num_seqs=args.max_num_seqs
    )
    launch = LaunchConfig.on_loopback(
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        log_dir=tempfile.mkdtemp(prefix="pagoda-serving-bench-"),
        metrics_port=-1,
    )
    backends: list[Backend] = []
    cluster = LocalCluster(launch)
    inproc: InProcessBackend | None = None
    try:
        if not args.skip_services:
            cluster.start()
        if not args.skip_inprocess:
            inproc = InProcessBackend(config)
            inproc.start(asyncio.get_running_loop())
            backends.append(inproc)
        if not args.skip_services:
            await asyncio.to_thread(cluster.wait_healthy, 600)
            backends.append(ServicesBackend(cluster.frontend_addr))
        return await bench(backends, args, vocab=49152 if inproc is None else inproc.engine.runner.info.vocab_size)
    finally:
        if inproc is not None:
            inproc.stop()
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second (0: skip)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per load level")
    p.add_argument("--max-duration", type=float, default=180.0, help="seconds per load level (bound)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument("--skip-services", action="store_true")
    p.add_argument("--note", default="", help="free text stored with the results (e.g. 'CPU shared')")
    p.add_argument("--replot", default=None, help="only redraw the PNG of an existing results JSON")
    args = p.parse_args()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot([LevelResult(**r) for r in saved["results"]], Path(args.replot).with_suffix(".png"))
        return
    results = asyncio.run(main_async(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = {
        "benchmark": "serving",
        "time": stamp,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: v for k, v in vars(args).items()},
        "results": [asdict(r) for r in results],
    }
    path = RESULTS / f"serving-{stamp}.json"
    path.write_text(json.dumps(out, indent=2))
    plot(results, RESULTS / f"serving-{stamp}.png")
    print(f"wrote {path} and {path.with_suffix('.png')}")
    by = {(r.backend, r.load): r for r in results}
    for r in results:
        if r.backend == "services" and ("in-process", r.load) in by:
            base = by[("in-process", r.load)]
            ratio = r.throughput_tok_s / base.throughput_tok_s
            added = r.latency_ms["ttft"]["p50"] - base.latency_ms["ttft"]["p50"]
            print(f"{r.load:9s} services/in-process throughput {ratio:6.1%}   added TTFT p50 {added:+7.1f} ms")


if __name__ == "__main__":
    main()
