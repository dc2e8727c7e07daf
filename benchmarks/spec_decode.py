"""Speculative decoding (ngram, or draft_model) on vs off, both arms in one process and one window, interleaved.

1. Batch 1, input-grounded: chat prompts whose answers copy spans of the prompt (repeat a paragraph, fix a
   function, extract fields, quote an earlier turn), greedy, one request alone in the engine: ms per output token
   (decode only, after the first token) through `LLM.generate`, acceptance rate and mean accepted length; the outputs
   of both arms must be identical.
2. The 64-request random workload (benchmarks/workload.py): total tok/s on vs off (the adaptive drafter must keep
   >= 0.97x: random tokens rarely recur, and 64 rows are past `disable_by_batch_size`).

    python benchmarks/spec_decode.py [--rounds 2] [--num-speculative-tokens 4] [--skip-random]
        [--method draft_model [--draft-model PATH]]  (default draft: the target itself, every draft accepted: the
        mechanism's overhead, not a real pairing's speed-up)

Appends one JSON line to benchmarks/results/spec_decode.jsonl.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from workload import make_workload

RESULTS = Path(__file__).parent / "results" / "spec_decode.jsonl"

PARAGRAPH = (
    "The night train to Vienna leaves platform 4 at 21:40 and arrives at 08:15. Sleeping cars have two or four "
    "berths; each berth has a reading light, a power socket and a small locker. Breakfast is served in the "
    "compartment from 07:00. Bicycles travel in the last carriage and must be booked in advance."
)
CODE = """def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)
"""
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
    f"Here is a Python function:\n\n{CODE}\nRewrite it so that it returns 0 for an empty list. "
    "Show the whole function.",
    f"From the text below, list every time and every number it mentions, quoting the sentence each comes from.\n\n"
    f"{PARAGRAPH}",
    f'Earlier you told me: "{PARAGRAPH}"\nQuote what you told me about bicycles and breakfast.',
]


class ArmView:
    """One arm of the A/B: the engine with its drafter (and, for draft_model, the worker's draft) set (on) or None."""

    def __init__(self, llm: Any, drafter: Any, draft: Any) -> None:
        self.llm, self.drafter, self.draft = llm, drafter, draft

    def use(self) -> Any:
        self.llm.core.scheduler.drafter = self.drafter
        self.llm.engine.runner.draft = self.draft  # NOTE: requests never straddle arms, so no draft state goes stale
        return self.llm


def make_llm(args: argparse.Namespace, spec: dict[str, Any] | None) -> Any:
    from engine_core import LLM

    return LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=64,
        # NOTE: each arm runs the same prompts: with the prefix cache the second arm's prefills would be hits.
        enable_prefix_caching=False,
        speculative_config=spec,
        num_threads=args.threads,
    )


STEP_MS: dict[str, list[float]] = {"plain": [], "verify": []}  # the on-arm's decode steps, by kind


def batch1(llm: Any, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    """ms per output token after the first, one request alone; its tokens. Each decode step's time is recorded in
    STEP_MS by kind (with drafts: "verify", the general forward; without: "plain", the native decode step)."""
    from engine_core import SamplingParams
    from engine_core.core.request import Request

    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    core = llm.core
    core.add_request(
        Request(f"b{time.monotonic_ns()}", list(ids), SamplingParams(temperature=0, max_tokens=max_tokens))
    )
    tokens: list[int] = []
    for o in core.step():  # prefill + first token
        tokens += o.new_token_ids
    t0 = time.perf_counter()
    while core.has_unfinished:
        drafter = core.scheduler.drafter
        drafts = drafter.stats.num_drafts if drafter is not None else 0
        s0 = time.perf_counter()
        for o in core.step():
            tokens += o.new_token_ids
        if drafter is not None:
            kind = "verify" if drafter.stats.num_drafts > drafts else "plain"
            STEP_MS[kind].append((time.perf_counter() - s0) * 1000)
    return (time.perf_counter() - t0) * 1000 / max(1, len(tokens) - 1), tokens


def random_workload(llm: Any, args: argparse.Namespace) -> float:
    from engine_core import SamplingParams

    wl = make_workload(args.num_requests, 0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.output_tokens
    return wl.total_tokens / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf; default SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="batch-1 rounds (arms alternate which goes first)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--skip-random", action="store_true")
    ap.add_argument("--random-arms", default="off,on,on,off", help="order of the random workload's runs")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft_model"])
    ap.add_argument("--draft-model", default=None, help="draft_model's draft; default the target itself")
    args = ap.parse_args()
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "draft_model":
        from engine_core.checkpoint.model_files import resolve_model_dir
        from engine_core.config import default_cache_dir

        spec["model"] = args.draft_model or resolve_model_dir(args.model, default_cache_dir())
    # NOTE: one engine, the drafter switched off and on between requests: the same weights and KV cache serve both
    # arms (two engines' memory got the process killed on the shared machine).
    llm = make_llm(args, spec)
    drafter = llm.core.scheduler.drafter
    draft = llm.engine.runner.draft
    arms = {"off": ArmView(llm, None, None), "on": ArmView(llm, drafter, draft)}
    batch1(arms["on"].use(), "Hello", 8)  # warm-up
    ms: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for i, prompt in enumerate(GROUNDED):
            order = ["off", "on"] if (r + i) % 2 == 0 else ["on", "off"]
            got = {}
            for arm in order:
                t, tokens = batch1(arms[arm].use(), prompt, args.max_tokens)
                ms[arm].append(t)
                got[arm] = tokens
            assert got["on"] == got["off"], f"prompt {i}: outputs differ with speculation"
            print(f"round {r} prompt {i}: off {ms['off'][-1]:.2f} ms/token, on {ms['on'][-1]:.2f} ms/token "
                  f"({len(got['on'])} tokens)", flush=True)  # fmt: skip
    stats = drafter.stats  # NOTE: the drafter's own counters: core.stats() reads none while the off arm is set
    result: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "spec": spec,
        "batch1_ms_per_token_off": sum(ms["off"]) / len(ms["off"]),
        "batch1_ms_per_token_on": sum(ms["on"]) / len(ms["on"]),
        "acceptance_rate": stats.acceptance_rate,
        "mean_accepted_length": stats.mean_accepted_length,
        "accepted_per_pos": list(stats.num_accepted_tokens_per_pos),
    }
    result["batch1_speedup"] = result["batch1_ms_per_token_off"] / result["batch1_ms_per_token_on"]
    for kind, values in STEP_MS.items():
        result[f"on_{kind}_step_ms"] = sum(values) / len(values) if values else None
        result[f"on_{kind}_steps"] = len(values)
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_random:
        tok_s: dict[str, list[float]] = {}
        for arm in args.random_arms.split(","):
            tok_s.setdefault(arm, []).append(random_workload(arms[arm].use(), args))
            print(f"random workload, {arm}: {tok_s[arm][-1]:.1f} tok/s", flush=True)
        result["random_tok_s_off"] = tok_s["off"]
        result["random_tok_s_on"] = tok_s["on"]
        result["random_ratio"] = sum(tok_s["on"]) / sum(tok_s["off"])
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
