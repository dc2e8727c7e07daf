"""Throughput of the three services with tracing off vs on (every request sampled, detailed traces).

Each round starts a fresh local cluster per mode (alternating, so drift in machine load hits both) and runs the same
closed-loop workload as benchmarks/serving.py: random token-id prompts, fixed output length (ignore_eos).
"on" points the services at an OTLP/gRPC sink in this process (a stand-in for Jaeger on 4317 that counts and drops
spans) with OTEL_TRACES_SAMPLER=always_on and --collect-detailed-traces; "off" sets no endpoint at all.

    PYTHONPATH=. python benchmarks/tracing_overhead.py [--rounds 2] [--concurrency 8] [--num-requests 48]

Writes benchmarks/results/tracing_overhead.json. The issue's bar: off within noise of before, on <= 5 % slower.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
from concurrent import futures
from dataclasses import asdict, dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from serving import RESULTS, LevelResult, ServicesBackend, run_concurrency, summarize

from services.launcher import LaunchConfig, LocalCluster


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


@dataclass
class ModeResult:
    mode: str
    round: int
    requests: int
    output_tokens: int
    duration_s: float
    throughput_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    spans_exported: int


async def _load(addr: str, args: argparse.Namespace, vocab: int) -> LevelResult:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    backend = ServicesBackend(addr)
    await run_concurrency(backend, prompts[:2], 2, 4, 60.0)  # warm-up: first-step costs, connections
    records, duration = await run_concurrency(backend, prompts, args.concurrency, args.max_tokens, args.max_seconds)
    return summarize("services", f"c={args.concurrency}", records, duration)


def run_mode(mode: str, rnd: int, args: argparse.Namespace, sink: _Sink, sink_endpoint: str) -> ModeResult:
    # NOTE: "off" disables the SDK explicitly, so an OTEL_EXPORTER_OTLP_ENDPOINT in the caller's shell cannot leak in.
    env = {"OTEL_SDK_DISABLED": "true"}
    if mode == "on":
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink_endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
    launch = LaunchConfig.on_loopback(
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        max_num_seqs=max(args.concurrency, 8),
        log_dir=tempfile.mkdtemp(prefix=f"pagoda-tracing-{mode}-"),
        metrics_port=-1,
        collect_detailed_traces=mode == "on",
        env=env,
    )
    cluster = LocalCluster(launch)
    before = sink.spans
    try:
        cluster.start()
        cluster.wait_healthy(600)
        lv = asyncio.run(_load(cluster.frontend_addr, args, vocab=49152))
    finally:
        cluster.stop()  # NOTE: the services flush their spans while stopping
    return ModeResult(
        mode=mode,
        round=rnd,
        requests=lv.requests,
        output_tokens=lv.output_tokens,
        duration_s=lv.duration_s,
        throughput_tok_s=lv.throughput_tok_s,
        ttft_p50_ms=lv.latency_ms["ttft"]["p50"],
        itl_p50_ms=lv.latency_ms["itl"]["p50"],
        spans_exported=sink.spans - before,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--kv-cache-memory", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    sink = _Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    results: list[ModeResult] = []
    try:
        for rnd in range(args.rounds):
            for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                r = run_mode(mode, rnd, args, sink, f"http://127.0.0.1:{port}")
                results.append(r)
                print(
                    f"round {rnd} {mode:3s}: {r.throughput_tok_s:8.1f} tok/s  TTFT p50 {r.ttft_p50_ms:7.1f} ms  "
                    f"ITL p50 {r.itl_p50_ms:6.1f} ms  spans {r.spans_exported}",
                    flush=True,
                )
    finally:
        server.stop(None)
    mean = {m: sum(r.throughput_tok_s for r in results if r.mode == m) / args.rounds for m in ("off", "on")}
    cost = 1 - mean["on"] / mean["off"]
    print(f"mean throughput: off {mean['off']:.1f} tok/s, on {mean['on']:.1f} tok/s: tracing costs {cost:.1%}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "tracing_overhead.json"
    out.write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results], "cost": cost}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
