"""Offline throughput: Pagoda's engine vs transformers `generate` (static batches) on one fixed workload.

Workload: 64 requests of random token ids, prompt lengths uniform in [64, 512], output lengths uniform in
[32, 256], greedy, ignore_eos, fixed seed. Also a batch-1 latency case (prompt 128, 128 new tokens).
Prints a table and appends one JSON line to benchmarks/results/offline_throughput.jsonl.

    python benchmarks/offline_throughput.py [--skip-hf] [--threads 2] [--device cuda --dtype bfloat16]

`benchmarks/gpu_check.py` calls `run_pagoda` / `run_hf` on a GPU with a random-weight SmolLM2-shaped model.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from workload import Workload, batch1_prompt, make_workload

RESULTS = Path(__file__).parent / "results" / "offline_throughput.jsonl"


@dataclass
class Result:
    system: str
    seconds: float
    total_tok_s: float
    output_tok_s: float
    batch1_ms_per_token: float | None = None


def run_pagoda(wl: Workload, args: argparse.Namespace) -> tuple[Result, list[list[int]]]:
    from engine_core import LLM, SamplingParams

    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
    )
    if not getattr(args, "mixed_graphs", True):
        # NOTE: the A/B switch of gpu_check's before/after: steps with prefill chunks run eagerly, as before
        # engine_core/worker/mixed_graphs.py (decode-only steps still replay their graphs).
        llm.engine.runner.mixed_step = None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (allocator, first-call overheads)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.output_tokens, f"expected {wl.output_tokens} output tokens, got {produced}"
    res = Result("pagoda", dt, wl.total_tokens / dt, wl.output_tokens / dt)
    res.batch1_ms_per_token = pagoda_batch1(llm, args)
    return res, [o.outputs[0].token_ids for o in outs]


def pagoda_batch1(llm: object, args: argparse.Namespace) -> float:
    """Time per output token after the first (decode only), one request alone in the engine."""
    from engine_core import SamplingParams
    from engine_core.core.request import Request

    core = llm.core  # type: ignore[attr-defined]
    prompt = batch1_prompt(args.batch1_prompt)
    params = SamplingParams(temperature=0, max_tokens=args.batch1_tokens, ignore_eos=True)
    core.add_request(Request("batch1", prompt, params))
    core.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1000


def hf_static_generate(model: object, prompts: list[list[int]], output_lens: list[int], batch: int) -> int:
    """transformers `generate` in static batches (left-padded; each batch runs to its longest output, only the
    requested tokens are counted); returns the number of requested output tokens."""
    pad = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        new = max(output_lens[start : start + batch])
        width = max(len(p) for p in chunk)
        device = model.device  # type: ignore[attr-defined]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.no_grad():
            model.generate(  # type: ignore[attr-defined]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad,
            )
    return sum(output_lens)


def run_hf(wl: Workload, args: argparse.Namespace, model_dir: str) -> Result:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(device).eval()
    pad = 0
    t0 = time.perf_counter()
    hf_static_generate(model, wl.prompts, wl.output_lens, args.hf_batch)
    dt = time.perf_counter() - t0
    res = Result("transformers", dt, wl.total_tokens / dt, wl.output_tokens / dt)
    prompt = torch.tensor([batch1_prompt(args.batch1_prompt)], device=device)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(input_ids=prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=pad)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = args.batch1_tokens
        model.generate(input_ids=prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        res.batch1_ms_per_token = (time.perf_counter() - t0 - ttft) / (n - 1) * 1000
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf; default SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=4.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--batch1-prompt", type=int, default=128)
    ap.add_argument("--batch1-tokens", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true", help="measure Pagoda only")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (both systems)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (both systems)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from peer_model import peer_model_dir

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import EngineConfig

    wl = make_workload(args.num_requests, args.seed)
    results = [run_pagoda(wl, args)[0]]
    if not args.skip_hf:
        cache_dir = EngineConfig().cache_dir
        results.append(run_hf(wl, args, peer_model_dir(resolve_model_dir(args.model, cache_dir), cache_dir)))

    print(f"\nworkload: {args.num_requests} requests, {wl.total_tokens} tokens ({wl.output_tokens} output)")
    print(f"{'system':<14}{'seconds':>9}{'total tok/s':>13}{'output tok/s':>14}{'batch-1 ms/tok':>16}")
    for r in results:
        b1 = f"{r.batch1_ms_per_token:.1f}" if r.batch1_ms_per_token else "-"
        print(f"{r.system:<14}{r.seconds:>9.1f}{r.total_tok_s:>13.1f}{r.output_tok_s:>14.1f}{b1:>16}")
    if len(results) == 2:
        print(f"ratio pagoda / transformers (total tok/s): {results[0].total_tok_s / results[1].total_tok_s:.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={args.threads}".strip(),
        "torch": torch.__version__,
        "args": vars(args),
        "results": [asdict(r) for r in results],
    }
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
