"""TTFT of a request that arrives while others decode: probes at random times against a running `pagoda serve`.

`--streams` closed-loop gRPC `Generate` streams keep the engine decoding (64-token prompts, 400 tokens each, restarted
when done); after a warm-up, `--probes` requests (128-token prompt, 1 token) arrive one at a time, 0.3-0.9 s apart,
and the time to their token is recorded. What it measures is the delay a new request sees behind the running batch:
the rest of the step in flight, any step planned before it arrived, and its own prefill. The all-at-once load of
side_by_side.py cannot show this (every request is there before the first step).

    pagoda serve &   # or any frontend address
    PYTHONPATH=$PWD python benchmarks/probe_ttft.py --addr 127.0.0.1:50051 [--streams 32] [--probes 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from serving import ServicesBackend
from workload import batch1_prompt

STREAM_PROMPT, STREAM_TOKENS, PROBE_PROMPT = 64, 400, 128


async def keep_decoding(backend: ServicesBackend, rng: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        prompt = [rng.randrange(1000, 20000) for _ in range(STREAM_PROMPT)]
        async for _ in backend.stream(prompt, STREAM_TOKENS):
            if stop.is_set():
                break


async def main(args: argparse.Namespace) -> None:
    backend = ServicesBackend(args.addr)
    rng = random.Random(args.seed)
    async for _ in backend.stream(batch1_prompt(), 1):  # the server answers before the clock starts
        pass
    stop = asyncio.Event()
    streams = [
        asyncio.create_task(keep_decoding(backend, random.Random(args.seed * 1000 + i), stop))
        for i in range(args.streams)
    ]
    await asyncio.sleep(args.warmup_s)  # every stream admitted and decoding
    ttfts: list[float] = []
    for _ in range(args.probes):
        await asyncio.sleep(rng.uniform(0.3, 0.9))
        prompt = [rng.randrange(1000, 20000) for _ in range(PROBE_PROMPT)]
        t0 = time.perf_counter()
        async for _ in backend.stream(prompt, 1):
            ttfts.append((time.perf_counter() - t0) * 1e3)
    stop.set()
    for task in streams:
        task.cancel()
    failed = [r for r in await asyncio.gather(*streams, return_exceptions=True) if isinstance(r, Exception)]
    if failed:  # NOTE: a stream that died left fewer decoding than asked for: the numbers would not mean that load
        raise SystemExit(f"{len(failed)} of {args.streams} background streams failed, e.g. {failed[0]!r}")
    p90 = statistics.quantiles(ttfts, n=10)[-1]
    print(
        f"probe TTFT ms, {args.streams} streams decoding: mean {statistics.mean(ttfts):.0f} "
        f"p50 {statistics.median(ttfts):.0f} p90 {p90:.0f} (n={len(ttfts)})"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default="127.0.0.1:50051", help="the frontend's gRPC address")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--probes", type=int, default=40)
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.probes < 2 or args.streams < 0:
        p.error("--probes must be >= 2 (for a p90) and --streams >= 0")
    asyncio.run(main(args))
