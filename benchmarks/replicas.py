"""Model replicas behind one frontend: routing policies on a multi-tenant prefix workload, and failover.

Workload: `--tenants` tenants, each with its own `--system-tokens`-token system prompt (random token ids, fixed
seed), `--requests` requests interleaved across tenants (each tenant equally often, in a seeded random order, a
distinct random tail of 16-48 tokens each), `--max-tokens` output tokens (ignore_eos), `--concurrency` streams at a
time through the frontend's gRPC API.
For each policy a fresh cluster of `--replicas` replicas (each a scheduler and a one-thread worker) runs it; a single
replica serving everything is the hit-rate reference. Reports per run: total tok/s (prompt + output tokens over the
wall time), output tok/s, the prefix-cache hit rate summed over the replicas' Stats, TTFT p50/p90.
Failover (`--failover`): the prefix policy again, with replica 1's scheduler SIGKILLed a third of the way through:
requests it held end UNAVAILABLE, the rest must succeed; then it is restarted and must take requests again.

    python benchmarks/replicas.py [--requests 256] [--policies prefix,round_robin,least_load] [--failover]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from services.common.grpc_opts import CHANNEL_OPTIONS
from services.common.health import SERVING, check
from services.launcher import LaunchConfig, LocalCluster
from services.rpc import (
    SCHEDULER_SERVICE,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

RESULTS = Path(__file__).parent / "results"
VOCAB = 49152  # SmolLM2


@dataclass
class RunResult:
    name: str
    replicas: int
    policy: str
    requests: int
    ok: int
    unavailable: int
    wall_s: float
    total_tok_s: float
    output_tok_s: float
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    per_replica_queries: list[int]


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    systems = [[rng.randrange(100, VOCAB) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    # NOTE: shuffled, not i % tenants: with an even number of replicas that order would line round_robin up with the
    # tenants (tenant t always on replica t % 2), a partition no real traffic gives it.
    order = [i % args.tenants for i in range(args.requests)]
    rng.shuffle(order)
    return [systems[t] + [rng.randrange(100, VOCAB) for _ in range(rng.randrange(16, 49))] for t in order]


def stats(addr: str) -> scheduler_pb2.StatsResponse | None:
    with grpc.insecure_channel(addr) as channel:
        try:
            return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None


async def one(stub: generation_pb2_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> tuple[float, int, str]:
    opts = common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling=opts)
    t0 = time.perf_counter()
    ttft, n = 0.0, 0
    try:
        async for msg in stub.Generate(req, timeout=600):
            k = sum(len(c.token_ids) for c in msg.choices)
            if k and not n:
                ttft = time.perf_counter() - t0
            n += k
    except grpc.aio.AioRpcError as e:
        return 0.0, 0, e.code().name
    return ttft, n, "OK"


async def drive(addr: str, prompts: list[list[int]], args: argparse.Namespace, on_progress=None) -> list:
    async with grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sem = asyncio.Semaphore(args.concurrency)
        done = 0

        async def task(p: list[int]) -> tuple[float, int, str]:
            nonlocal done
            async with sem:
                r = await one(stub, p, args.max_tokens)
            done += 1
            if on_progress is not None:
                on_progress(done)
            return r

        return await asyncio.gather(*(task(p) for p in prompts))


def start(args: argparse.Namespace, replicas: int, policy: str, log_dir: str) -> LocalCluster:
    config = LaunchConfig.on_loopback(
        replicas=replicas,
        dtype="float32",
        kv_cache_memory=args.kv_cache_memory,
        num_threads=1,
        max_num_seqs=args.concurrency,
        metrics_port=-1,
        log_dir=log_dir,
        extra_frontend_args=["--routing-policy", policy],
        extra_worker_args=["--max-model-len", str(args.max_model_len)] if args.max_model_len else [],
    )
    cluster = LocalCluster(config)
    cluster.start()
    cluster.wait_healthy(600)
    # NOTE: the frontend serves once one replica does; its health checks (every second) see the others soon after.
    time.sleep(2.0)
    return cluster


def run(args: argparse.Namespace, name: str, replicas: int, policy: str, failover: bool = False) -> RunResult:
    prompts = workload(args)
    log_dir = tempfile.mkdtemp(prefix=f"replicas-{name}-")
    cluster = start(args, replicas, policy, log_dir)
    killed: dict[str, float] = {}
    try:

        def progress(done: int) -> None:
            if failover and not killed and done >= len(prompts) // 3:
                victim = cluster.service("scheduler1")
                victim.process.kill()
                killed["at"] = time.perf_counter()

        before = [stats(a) for a in cluster.scheduler_addrs]
        t0 = time.perf_counter()
        results = asyncio.run(drive(cluster.frontend_addr, prompts, args, progress))
        wall = time.perf_counter() - t0
        after = [stats(a) for a in cluster.scheduler_addrs]
        queries = [
            (a.prefix_cache_queries - b.prefix_cache_queries) if a and b else 0
            for a, b in zip(after, before, strict=True)
        ]
        hits = sum(
            (a.prefix_cache_hits - b.prefix_cache_hits) if a and b else 0 for a, b in zip(after, before, strict=True)
        )
        if failover:
            cluster.service("scheduler1").process.wait(30)
            cluster.restart("scheduler1")
            deadline = time.monotonic() + 120
            while check(cluster.scheduler_addrs[1], SCHEDULER_SERVICE) != SERVING and time.monotonic() < deadline:
                time.sleep(0.5)
            rejoin = asyncio.run(drive(cluster.frontend_addr, workload(args)[:16], args))
            s = stats(cluster.scheduler_addrs[1])
            print(
                f"failover: after the restart {sum(r[2] == 'OK' for r in rejoin)}/16 ok, "
                f"restarted replica ran {s.steps if s else 0} steps"
            )
    finally:
        cluster.stop(timeout=60)
    ok = [r for r in results if r[2] == "OK"]
    ttfts = [r[0] * 1000 for r in ok if r[1]]
    out_tokens = sum(r[1] for r in ok)
    prompt_tokens = sum(len(p) for p, r in zip(prompts, results, strict=True) if r[2] == "OK")
    total_q = sum(queries)
    return RunResult(
        name=name,
        replicas=replicas,
        policy=policy,
        requests=len(prompts),
        ok=len(ok),
        unavailable=sum(r[2] == "UNAVAILABLE" for r in results),
        wall_s=round(wall, 2),
        total_tok_s=round((prompt_tokens + out_tokens) / wall, 1),
        output_tok_s=round(out_tokens / wall, 1),
        hit_rate=round(hits / total_q, 4) if total_q else 0.0,
        ttft_p50_ms=round(float(np.percentile(ttfts, 50)), 1) if ttfts else 0.0,
        ttft_p90_ms=round(float(np.percentile(ttfts, 90)), 1) if ttfts else 0.0,
        per_replica_queries=queries,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per replica")
    p.add_argument("--max-model-len", type=int, default=0, help="the workers' (0: the model's); lets a small cache fit")
    p.add_argument("--policies", default="prefix,round_robin,least_load")
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True, help="the one-replica reference")
    p.add_argument("--failover", action="store_true")
    args = p.parse_args()
    out: list[RunResult] = []
    if args.single:
        out.append(run(args, "single", 1, "prefix"))
        print(out[-1])
    for policy in args.policies.split(","):
        out.append(run(args, policy, args.replicas, policy))
        print(out[-1])
    if args.failover:
        out.append(run(args, "failover", args.replicas, "prefix", failover=True))
        print(out[-1])
    print(
        f"\n{'run':12s} {'repl':>4s} {'ok':>4s} {'unav':>4s} {'wall s':>7s} {'tok/s':>7s} {'out/s':>6s} "
        f"{'hit':>6s} {'TTFT p50':>9s} {'p90':>8s}  queries per replica"
    )
    for r in out:
        print(
            f"{r.name:12s} {r.replicas:4d} {r.ok:4d} {r.unavailable:4d} {r.wall_s:7.1f} {r.total_tok_s:7.1f} "
            f"{r.output_tok_s:6.1f} {r.hit_rate:6.3f} {r.ttft_p50_ms:9.0f} {r.ttft_p90_ms:8.0f}  "
            f"{r.per_replica_queries}"
        )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"replicas-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"args": vars(args), "runs": [asdict(r) for r in out]}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
