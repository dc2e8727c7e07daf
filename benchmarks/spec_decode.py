"""Speculative decoding (ngram, suffix, draft_model) on vs off, all arms in one process and one window, interleaved.

1. Batch 1, input-grounded: chat prompts whose answers copy spans of the prompt (repeat a paragraph, fix a
   function, extract fields, quote an earlier turn), greedy, one request alone in the engine: ms per output token
   (decode only, after the first token) through `LLM.generate`, acceptance rate and mean accepted length; the outputs
   of every arm must be identical.
2. Batch 1, agentic: one prompt family (a triage agent's fixed instructions and JSON answer format, a different
   ticket each time) repeated across requests, where other requests' outputs help the suffix method.
3. With --grpc ARMS: the input-grounded prompts through the public gRPC `Generate` stream of local clusters (one per
   arm and off, all up at once, as `pagoda serve --speculative-config` starts them: spec_grpc.py).
4. The 64-request random workload (benchmarks/workload.py): total tok/s on vs off (the adaptive drafter must keep
   >= 0.97x: random tokens rarely recur, and 64 rows are past `disable_by_batch_size`).

    python benchmarks/spec_decode.py [--rounds 2] [--methods ngram,suffix[,draft_model]] [--draft-model PATH]
        [--grpc suffix] [--skip-agentic] [--skip-random]

An arm is a method with its defaults (SpeculativeConfig) or `method:k` (num_speculative_tokens k), e.g.
`--methods suffix,suffix:4,ngram:8`. draft_model's default draft is the target itself: every draft accepted, so it
shows the mechanism's overhead, not a real pairing's speed-up.

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

TRIAGE = (
    "You are a support triage agent. Read the ticket and answer with exactly this JSON and nothing else:\n"
    '{"ticket": <id>, "team": "billing" | "network" | "accounts", "priority": "low" | "high", '
    '"summary": "<one sentence>"}\n\nTicket '
)
TICKETS = [
    "1041: My invoice for March was charged twice to my credit card.",
    "1042: The office VPN drops every ten minutes since the update.",
    "1043: I cannot log in; the password reset email never arrives.",
    "1044: Please send me a copy of the invoice for April.",
    "1045: Our whole team lost internet access this morning.",
    "1046: I want to change the email address on my account.",
]
AGENTIC = [TRIAGE + t for t in TICKETS]
# Open-ended: answers that copy nothing from the prompt, where drafts are mostly rejected (the back-off's case).
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a rainy weekend with children, with a sentence on each.",
    "What are the pros and cons of working from home?",
]


class ArmView:
    """One arm of the A/B: the engine with its drafter (and, for draft_model, the worker's draft) set, or None (off)."""

    def __init__(self, llm: Any, drafter: Any, draft: Any = None) -> None:
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


STEP_MS: dict[tuple[str, str], list[float]] = {}  # (arm, "verify" | "plain") -> each decode step's ms
OUTPUTS: dict[tuple[str, int], list[int]] = {}  # (workload, prompt index) -> its output (round 0; every arm's)


def batch1(llm: Any, arm: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> tuple[float, list[int]]:
    """ms per output token after the first, one request alone; its tokens. Each decode step's time is recorded in
    STEP_MS by arm and kind (with drafts: "verify", 1 + k decode rows per verified row; without: "plain").

    NOTE: the request stops at the model's EOS as `LLM.generate` makes it (`with_eos`), unless `ignore_eos`: past
    EOS this model writes an invented next turn ("<|im_start|>user ..."), text that is neither the answer nor
    grounded in the prompt."""
    from engine_core import SamplingParams
    from engine_core.core.request import Request
    from engine_core.sampling_params import with_eos

    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    core = llm.core
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    params = with_eos(params, llm.engine.eos_token_id, llm.engine.runner.info.vocab_size)
    core.add_request(Request(f"b{time.monotonic_ns()}", list(ids), params))
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
            STEP_MS.setdefault((arm, kind), []).append((time.perf_counter() - s0) * 1000)
    return (time.perf_counter() - t0) * 1000 / max(1, len(tokens) - 1), tokens


def run_batch1(
    arms: dict[str, ArmView], name: str, prompts: list[str], rounds: int, max_tokens: int, ignore_eos: bool
) -> dict[str, Any]:
    """Every prompt through every arm (the order rotating prompt by prompt); per arm: mean ms/token, acceptance."""
    from engine_core.spec_decode.stats import SpecDecodeStats

    for view in arms.values():
        if view.drafter is not None:
            view.drafter.stats = SpecDecodeStats()  # this workload's counters alone
    STEP_MS.clear()
    names = list(arms)
    ms: dict[str, list[float]] = {a: [] for a in names}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            shift = (r + i) % len(names)
            got = {}
            for arm in names[shift:] + names[:shift]:
                t, tokens = batch1(arms[arm].use(), arm, prompt, max_tokens, ignore_eos)
                ms[arm].append(t)
                got[arm] = tokens
            assert all(tokens == got["off"] for tokens in got.values()), f"{name} {i}: outputs differ"
            OUTPUTS.setdefault((name, i), got["off"])
            line = ", ".join(f"{a} {ms[a][-1]:.2f}" for a in names)
            print(f"{name} round {r} prompt {i} ({len(got['off'])} tokens), ms/token: {line}", flush=True)
    result: dict[str, Any] = {}
    off = sum(ms["off"]) / len(ms["off"])
    for arm in names:
        mean = sum(ms[arm]) / len(ms[arm])
        row: dict[str, Any] = {"ms_per_token": mean, "per_prompt": ms[arm], "speedup": off / mean}
        drafter = arms[arm].drafter
        if drafter is not None:
            stats = drafter.stats
            row |= {
                "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length,
                "accepted_per_pos": list(stats.num_accepted_tokens_per_pos),
                "num_drafts": stats.num_drafts,
            }
            for kind in ("plain", "verify"):
                values = STEP_MS.get((arm, kind), [])
                row[f"{kind}_step_ms"] = sum(values) / len(values) if values else None
                row[f"{kind}_steps"] = len(values)
        result[arm] = row
    return result


def random_workload(llm: Any, args: argparse.Namespace) -> float:
    from engine_core import SamplingParams

    wl = make_workload(args.num_requests, 0)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.output_tokens
    return wl.total_tokens / dt


def arm_spec(arm: str) -> dict[str, Any]:
    """`method` (its defaults) or `method:k` -> the speculative_config."""
    method, _, k = arm.partition(":")
    return {"method": method} | ({"num_speculative_tokens": int(k)} if k else {})


def run_grpc(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The grounded prompts through gRPC Generate streams, off and each arm of --grpc (spec_grpc.py)."""
    import spec_grpc

    prompts = [
        list(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in GROUNDED
    ]
    expected = [OUTPUTS[("grounded", i)] for i in range(len(prompts))] if ("grounded", 0) in OUTPUTS else None
    arms = [spec_grpc.GrpcArm("off", None)] + [spec_grpc.GrpcArm(a, arm_spec(a)) for a in args.grpc.split(",")]
    try:
        spec_grpc.start(arms, args.model, args.threads, args.kv_cache_memory)
        return spec_grpc.run(arms, prompts, args.grpc_rounds, args.max_tokens, expected, args.ignore_eos)
    finally:
        spec_grpc.stop(arms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf; default SmolLM2-135M-Instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="batch-1 rounds (arms alternate which goes first)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ignore-eos", action="store_true", help="batch-1 requests run to max_tokens past EOS")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--methods", default="ngram,suffix", help="the on-arms (method or method:k), one drafter each")
    ap.add_argument("--draft-model", default=None, help="draft_model's draft; default the target itself")
    ap.add_argument("--grpc", default="", help="on-arms (method or method:k) also run through gRPC Generate streams")
    ap.add_argument("--grpc-rounds", type=int, default=1, help="gRPC rounds (1: every prompt first seen)")
    ap.add_argument("--skip-agentic", action="store_true")
    ap.add_argument("--skip-random", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true", help="the random workload only")
    ap.add_argument("--random-arms", default="off,ngram,suffix", help="order of the random workload's runs")
    args = ap.parse_args()
    from engine_core.spec_decode.config import SpeculativeConfig
    from engine_core.spec_decode.drafter import Drafter

    specs = {arm: arm_spec(arm) for arm in args.methods.split(",")}
    if "draft_model" in specs:
        from engine_core.checkpoint.model_files import resolve_model_dir
        from engine_core.config import default_cache_dir

        specs["draft_model"]["model"] = args.draft_model or resolve_model_dir(args.model, default_cache_dir())
    # NOTE: one engine, its drafter swapped between requests: the same weights and KV cache serve every arm (two
    # engines' memory got the process killed on the shared machine). With draft_model the engine is made with it, so
    # the worker loads the draft; the other arms run without it.
    first = specs.get("draft_model") or next(iter(specs.values()))
    llm = make_llm(args, first)
    draft = llm.engine.runner.draft
    arms = {"off": ArmView(llm, None)}
    for method, spec in specs.items():
        parsed = SpeculativeConfig.parse(spec)
        assert parsed is not None
        arms[method] = ArmView(llm, Drafter(parsed), draft if method == "draft_model" else None)
    batch1(arms["off"].use(), "off", "Hello", 8)  # warm-up
    result: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), "specs": specs}
    if not args.skip_batch1:
        result["grounded"] = run_batch1(arms, "grounded", GROUNDED, args.rounds, args.max_tokens, args.ignore_eos)
        if not args.skip_agentic:
            result["agentic"] = run_batch1(arms, "agentic", AGENTIC, args.rounds, args.max_tokens, args.ignore_eos)
    print(json.dumps(result, indent=1), flush=True)
    if args.grpc:
        result["grpc_grounded"] = run_grpc(llm, args)
        print(json.dumps(result["grpc_grounded"], indent=1), flush=True)
    if not args.skip_random:
        tok_s: dict[str, list[float]] = {}
        for arm in args.random_arms.split(","):
            tok_s.setdefault(arm, []).append(random_workload(arms[arm].use(), args))
            print(f"random workload, {arm}: {tok_s[arm][-1]:.1f} tok/s", flush=True)
        result["random_tok_s"] = tok_s
        result["random_ratio"] = {a: sum(v) / sum(tok_s["off"]) for a, v in tok_s.items()}
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
