"""Memory of `pagoda serve` (its defaults) holding a full queue: N gRPC Generate streams of P-token prompts opened at
once; each service's RSS idle, at peak while they are held, and after the clients cancel, and the statuses the
streams ended with (beyond the scheduler's capacity: RESOURCE_EXHAUSTED). What the chart's memory requests are
checked against (docs/reliability.md, Figures).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/full_queue.py [--streams 1400] [--prompt-tokens 8000] [--hold 25]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

REPO = Path(__file__).resolve().parents[1]


def services(pid: int) -> dict[str, psutil.Process]:
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        module = next((a for a in child.cmdline() if a.startswith("services.") and a != "services.cli"), None)
        if module:
            found[module.split(".")[1]] = child
    return found


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, int]:
    return {name: round(p.memory_info().rss / 1e6) for name, p in sorted(procs.items())}


async def run(args: argparse.Namespace, grpc_addr: str, serve_pid: int) -> None:
    from services.rpc import common_pb2, generation_pb2, generation_pb2_grpc

    channel = grpc.aio.insecure_channel(grpc_addr, options=[("grpc.max_send_message_length", 64 << 20)])
    stub = generation_pb2_grpc.GenerationStub(channel)
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            await stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=2)
            break
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)
    procs = services(serve_pid)
    print(f"idle RSS MB: {rss_mb(procs)}", flush=True)
    rng = random.Random(0)
    statuses: collections.Counter[str] = collections.Counter()
    calls = []

    async def one() -> None:
        ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingOptions(max_tokens=1)
        )
        call = stub.Generate(request)
        calls.append(call)
        try:
            async for _ in call:
                pass
            statuses["OK"] += 1
        except grpc.aio.AioRpcError as e:
            statuses[e.code().name] += 1

    tasks = [asyncio.create_task(one()) for _ in range(args.streams)]
    peak = {name: 0 for name in procs}
    end = time.monotonic() + args.hold
    while time.monotonic() < end:
        for name, mb in rss_mb(procs).items():
            peak[name] = max(peak[name], mb)
        await asyncio.sleep(0.2)
    print(f"held {args.hold:g} s: statuses {dict(statuses)}; peak RSS MB: {peak}", flush=True)
    for call in calls:
        call.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(5)
    print(f"5 s after the clients cancelled: RSS MB {rss_mb(procs)}", flush=True)
    await channel.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1400)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--hold", type=float, default=25.0, help="seconds the streams are held open")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for pagoda serve")
    args = ap.parse_args()

    from services.launcher import free_port

    grpc_port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc_port)]
    cmd += ["--http-port", str(free_port()), "--scheduler-port", str(free_port()), "--worker-port", str(free_port())]
    cmd += ["--log-dir", tempfile.mkdtemp(prefix="pagoda-full-queue-")]
    serve = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(run(args, f"127.0.0.1:{grpc_port}", serve.pid))
    finally:
        serve.terminate()
        serve.wait(60)


if __name__ == "__main__":
    main()
