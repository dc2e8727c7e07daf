"""Several `LLM` configurations in one process, alternated: the 64-request random workload (offline_throughput.py's)
through each in turn, `--rounds` times, then batch 1; total tok/s per round and each arm's ratio to the first.

Why one process, alternated: on a shared machine the load changes within minutes, and the engines slow by
different factors under it, so only arms measured side by side in one window compare.

    PYTHONPATH=$PWD python benchmarks/engine_ab.py --arms '{"fp32": {"dtype": "float32"},
        "bf16": {"dtype": "bfloat16"}}' [--rounds 2] [--requests 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from workload import BATCH1_TOKENS, batch1_prompt, make_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", required=True, help='JSON: {"name": {LLM(...) arguments}, ...}; the first is the base')
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB per LLM")
    args = ap.parse_args()

    from engine_core import LLM, SamplingParams

    arms: dict[str, dict[str, object]] = json.loads(args.arms)
    wl = make_workload(args.requests, args.seed)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llms = {name: LLM(args.model, kv_cache_memory=args.kv_cache_memory, **kw) for name, kw in arms.items()}
    for llm in llms.values():
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.output_tokens
            rates[name].append(wl.total_tokens / dt)
            print(f"round {r}: {name}: {wl.total_tokens / dt:.1f} total tok/s ({dt:.1f} s)", flush=True)
    b1 = SamplingParams(temperature=0, max_tokens=BATCH1_TOKENS + 1, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = [{"prompt_token_ids": batch1_prompt()}]
    batch1: dict[str, float] = {}
    for name, llm in llms.items():
        # NOTE: a 1-token call against a 129-token call: the difference is 128 decode steps (offline_run.py's way)
        t0 = time.perf_counter()
        llm.generate(prompt, one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompt, b1, use_tqdm=False)
        batch1[name] = ((time.perf_counter() - t1) - (t1 - t0)) / BATCH1_TOKENS * 1000
    base = next(iter(arms))
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"| arm | total tok/s (rounds) | median | vs {base} | batch 1, ms/token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in arms:
        med = statistics.median(rates[name])
        ratio = med / statistics.median(rates[base])
        runs = ", ".join(f"{x:.1f}" for x in rates[name])
        print(f"| {name} | {runs} | {med:.1f} | {ratio:.2f}x | {batch1[name]:.1f} |")


if __name__ == "__main__":
    main()
