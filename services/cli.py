"""`pagoda`: serve the three services locally, generate through them (or offline), or run one service.

pagoda serve [--demo]                 scheduler + worker + frontend on localhost, until Ctrl-C
pagoda generate --prompt "..."        offline engine (engine_core.LLM), no server
pagoda generate --server ADDR ...     streams through a frontend's gRPC API
pagoda worker|scheduler|frontend ...  one service (what a Kubernetes pod runs); see `--help` of each
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import TextIO

from engine_core.config import QUANTIZATIONS, EngineConfig
from engine_core.spec_decode.config import SpeculativeConfig
from services.common import ports
from services.common.engine_flags import field_default, json_config

DEMO_PROMPT = "Write a haiku about a pagoda in the rain."


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="send it as a chat message")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def stream_generation(addr: str, args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Streams one generation from a frontend to `out`; returns the process exit code."""
    import grpc

    from services.client import GenerationClient, text_request
    from services.rpc import common_pb2

    extra = {"seed": args.seed} if args.seed is not None else {}
    request = text_request(args.prompt, args.max_tokens, args.temperature, chat=args.chat, top_p=args.top_p, **extra)
    with GenerationClient(addr) as client:
        try:
            for msg in client.stream(request):
                for d in msg.choices:
                    print(d.text, end="", flush=True, file=out)
                if msg.HasField("final"):
                    f = msg.final
                    reason = common_pb2.FinishReason.Name(f.choices[0].finish_reason) if f.choices else "?"
                    print(file=out)
                    print(
                        f"[{f.usage.completion_tokens} tokens, {reason.removeprefix('FINISH_REASON_').lower()}, "
                        f"TTFT {f.timings.ttft_s * 1000:.0f} ms, total {f.timings.e2e_s:.2f} s]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _generate_offline(args: argparse.Namespace) -> int:
    from engine_core import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.server:
        return stream_generation(args.server, args)
    return _generate_offline(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from services.common.logs import configure_logging
    from services.common.threads import default_worker_threads
    from services.launcher import LaunchConfig, LocalCluster
    from services.supervisor import Supervisor

    configure_logging("serve")
    if not 1 <= args.replicas <= 16:
        print(f"--replicas must be between 1 and 16, got {args.replicas}", file=sys.stderr)
        return 2
    if not 1 <= args.tensor_parallel_size <= 64:
        print(f"--tensor-parallel-size must be between 1 and 64, got {args.tensor_parallel_size}", file=sys.stderr)
        return 2
    config = LaunchConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        scheduler_port=args.scheduler_port,
        worker_ports=[args.worker_port + i for i in range(args.tensor_parallel_size)],
        num_threads=args.worker_threads or default_worker_threads(args.tensor_parallel_size * args.replicas),
        log_dir=args.log_dir,
        metrics_port=args.metrics_port,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        collect_detailed_traces=args.collect_detailed_traces,
        extra_frontend_args=_tool_args(args),
    )
    config.with_replicas(args.replicas)
    config.extra_scheduler_args += scheduler_args(args)
    if args.speculative_config is not None:
        flag = ["--speculative-config", args.speculative_config.to_json()]
        config.extra_scheduler_args += flag
        config.extra_worker_args += flag  # NOTE: a draft_model method's draft runs in the worker
    cluster = LocalCluster(config)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
        first = "a first start writes the model's config and tokenizer once, ~12 s"
        print(f"starting worker, scheduler and frontend ({first})...", file=sys.stderr)
        cluster.wait_healthy(args.startup_timeout)
        print("pagoda is serving:", file=sys.stderr)
        for name, addr in cluster.addresses().items():
            print(f"  {name:24s} {addr}", file=sys.stderr)
        if args.demo:
            print(f"\n> {args.prompt}", file=sys.stderr)
            stream_generation(cluster.frontend_addr, args)
        print("\nserving until Ctrl-C", file=sys.stderr)
        # NOTE: with replicas, a dead scheduler is restarted too: the frontend routes around it meanwhile.
        restartable = ("worker", "scheduler") if args.replicas > 1 else ("worker",)
        supervisor = Supervisor(cluster, lambda name: name.startswith(restartable))
        while not stop.wait(0.5):
            gave_up = supervisor.check()
            if gave_up:
                print(f"{', '.join(gave_up)} exited: shutting down", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping (draining in-flight requests)...", file=sys.stderr)
        # NOTE: Ctrl-C reaches the children too (same process group); they drain on SIGINT like on SIGTERM.
        codes = cluster.stop()
        print(f"stopped: {codes}", file=sys.stderr)
    return 0


def scheduler_args(args: argparse.Namespace) -> list[str]:
    """Engine flags of `serve` that only the scheduler reads, passed on as its own flags."""
    return ["--structured-outputs-compile-timeout", repr(args.structured_outputs_compile_timeout)]


def _compile_timeout(text: str) -> float:
    """`--structured-outputs-compile-timeout`, refused at parse (before any service starts) by EngineConfig's rule."""
    value = float(text)
    try:
        EngineConfig(structured_outputs_compile_timeout=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _tool_args(args: argparse.Namespace) -> list[str]:
    """vLLM's tool flags of `serve`, passed on to the frontend (which checks them)."""
    out = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    return out + (["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else [])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda", description="Pagoda LLM serving")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run scheduler, worker(s) and frontend locally")
    serve.add_argument("--demo", action="store_true", help="stream one generation through gRPC once healthy")
    serve.add_argument("--model", default=None)
    serve.add_argument("--dtype", default=field_default("dtype"))
    serve.add_argument("--kv-cache-dtype", default=field_default("kv_cache_dtype"), help="auto | bfloat16 | float32")
    serve.add_argument(
        "--quantization",
        default=field_default("quantization"),
        choices=QUANTIZATIONS,
        help="gguf (a .gguf model) | gguf_a8 (a .gguf model, 8-bit activations) | int8 | compressed-tensors",
    )
    serve.add_argument(
        "--kv-cache-memory", type=float, default=field_default("kv_cache_memory"), help="GiB of KV cache per worker"
    )
    serve.add_argument("--host", default="0.0.0.0", help="the frontend's bind address")
    serve.add_argument("--grpc-port", type=int, default=ports.FRONTEND_GRPC_PORT)
    serve.add_argument("--http-port", type=int, default=ports.FRONTEND_HTTP_PORT)
    serve.add_argument("--scheduler-port", type=int, default=ports.SCHEDULER_PORT)
    serve.add_argument(
        "--worker-port", type=int, default=ports.WORKER_PORT, help="first worker's port (then +1 per worker)"
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=field_default("tensor_parallel_size"),
        help="worker ranks the model is split over (one worker process per rank, on loopback)",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="model replicas (each a scheduler and its workers; replica k at the ports + k x 100) behind one frontend",
    )
    serve.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads per worker (default: the usable cores divided among the workers; the scheduler and "
        "frontend run one thread each and never spin)",
    )
    serve.add_argument(
        "--speculative-config",
        type=json_config(SpeculativeConfig.parse),
        default=None,
        help='speculative decoding as JSON (vLLM\'s keys), e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    serve.add_argument(
        "--structured-outputs-compile-timeout",
        type=_compile_timeout,
        default=field_default("structured_outputs_compile_timeout"),
        help="seconds a structured-output request waits for its grammar to compile before it fails alone",
    )
    serve.add_argument("--log-dir", default=None, help="write each service's log there instead of stderr")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=ports.SCHEDULER_METRICS_PORT,
        help="scheduler /metrics (worker r: +1+r; -1: off; frontend: HTTP)",
    )
    serve.add_argument("--otlp-traces-endpoint", default=None, help="OTLP collector (default: OTEL_* variables)")
    serve.add_argument("--collect-detailed-traces", action="store_true", help="trace engine steps and worker steps")
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    serve.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='serve tool_choice "auto" (needs --tool-call-parser)'
    )
    serve.add_argument("--tool-call-parser", default=None, help="the model's tool-call format: hermes | llama3_json")
    _add_sampling_args(serve)

    gen = sub.add_parser("generate", help="generate a completion (offline, or through --server)")
    gen.add_argument(
        "--server", default=None, help=f"a frontend's gRPC address, e.g. localhost:{ports.FRONTEND_GRPC_PORT}"
    )
    gen.add_argument("--model", default=None, help="offline only")
    gen.add_argument("--dtype", default=field_default("dtype"), help="offline only")
    # NOTE: a smaller cache than the engine's default on purpose: one prompt needs little, and it starts faster.
    gen.add_argument("--kv-cache-memory", type=float, default=0.5, help="offline only")
    _add_sampling_args(gen)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # NOTE: the per-service commands parse their own flags (and PAGODA_* variables).
    if argv and argv[0] in ("worker", "scheduler", "frontend"):
        name, rest = argv[0], argv[1:]
        if name == "worker":
            from services.worker.server import main as service_main
        else:
            from services.common.threads import limit_control_process_threads

            limit_control_process_threads()  # NOTE: before the server's imports load torch
            if name == "scheduler":
                from services.scheduler.server import main as service_main
            else:
                from services.frontend.server import main as service_main
        return service_main(rest)
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _cmd_serve(args)
    return _cmd_generate(args)


if __name__ == "__main__":
    raise SystemExit(main())
