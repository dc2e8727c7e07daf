"""spec_decode.py's gRPC arm: the input-grounded prompts, batch 1, through the public `Generate` stream of local
clusters (frontend -> scheduler -> worker processes, as `pagoda serve` starts them), one cluster per arm (off, and
each method with its `--speculative-config`), all up at once and the arm order rotating prompt by prompt.

Time per output token after the first: from the stream message that carried the first token to the last message,
over the tokens after the first message (with speculation one message may carry several tokens).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GrpcArm:
    name: str
    spec: dict[str, Any] | None
    cluster: Any = None
    stub: Any = None
    ms: list[float] = field(default_factory=list)


def start(arms: list[GrpcArm], model: str | None, threads: int, kv_cache_memory: float) -> None:
    """Starts every arm's cluster (in parallel) and waits until all serve."""
    import grpc

    from services.launcher import LaunchConfig, LocalCluster
    from services.rpc import generation_pb2_grpc

    for arm in arms:
        flag = ["--speculative-config", json.dumps(arm.spec)] if arm.spec is not None else []
        launch = LaunchConfig.on_loopback(
            model=model,
            kv_cache_memory=kv_cache_memory,
            num_threads=threads,
            max_num_seqs=64,
            log_dir=tempfile.mkdtemp(prefix=f"pagoda-spec-grpc-{arm.name.replace(':', '-')}-"),
            metrics_port=-1,
            extra_scheduler_args=list(flag),
            extra_worker_args=list(flag),  # NOTE: as `pagoda serve` passes it (a draft model runs in the worker)
        )
        arm.cluster = LocalCluster(launch)
        arm.cluster.start()
    for arm in arms:
        arm.cluster.wait_healthy(900)
        arm.stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(arm.cluster.frontend_addr))


def stop(arms: list[GrpcArm]) -> None:
    for arm in arms:
        if arm.cluster is not None:
            arm.cluster.stop()


def generate(stub: Any, prompt_ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[float, list[int]]:
    """One greedy request on a Generate stream: ms per output token after the first, and its tokens.
    `ignore_eos` as the in-process arms' requests: the same tokens and token counts on both paths."""
    from services.rpc import common_pb2, generation_pb2

    opts = common_pb2.SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt_ids), sampling=opts)
    tokens: list[int] = []
    first_at, first_n, last_at = 0.0, 0, 0.0
    for msg in stub.Generate(req):
        new = [t for c in msg.choices for t in c.token_ids]
        if not new:
            continue
        now = time.perf_counter()
        if not tokens:
            first_at, first_n = now, len(new)
        tokens += new
        last_at = now
    after = len(tokens) - first_n
    return ((last_at - first_at) * 1000 / after if after else float("nan")), tokens


def run(
    arms: list[GrpcArm],
    prompts: list[list[int]],
    rounds: int,
    max_tokens: int,
    expected: list[list[int]] | None,
    ignore_eos: bool,
) -> dict[str, Any]:
    """Every prompt through every arm's stream (order rotating); the outputs of all arms must be identical (and,
    given `expected`, the in-process off arm's). Per arm: mean ms/token, per prompt, speed-up against off."""
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            shift = (r + i) % len(arms)
            got: dict[str, list[int]] = {}
            for arm in arms[shift:] + arms[:shift]:
                ms, tokens = generate(arm.stub, ids, max_tokens, ignore_eos)
                arm.ms.append(ms)
                got[arm.name] = tokens
            want = expected[i] if expected is not None else got[arms[0].name]
            if not all(t == want for t in got.values()):
                first = {
                    n: next((j for j, (a, b) in enumerate(zip(t, want, strict=False)) if a != b), len(t))
                    for n, t in got.items()
                }
                lens = {n: len(t) for n, t in got.items()}
                raise AssertionError(f"gRPC prompt {i}: outputs differ (first difference {first}, lengths {lens})")
            line = ", ".join(f"{a.name} {a.ms[-1]:.2f}" for a in arms)
            print(f"grpc round {r} prompt {i} ({len(want)} tokens), ms/token: {line}", flush=True)
    off = sum(arms[0].ms) / len(arms[0].ms)
    return {
        a.name: {"ms_per_token": sum(a.ms) / len(a.ms), "per_prompt": a.ms, "speedup": off / (sum(a.ms) / len(a.ms))}
        for a in arms
    }
