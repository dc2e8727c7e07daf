"""Draft length by replay: how many decode steps each proposer and k need on the input-grounded prompts, and what
that makes per output token given the measured cost of a verification step by its rows.

Greedy output is the same with and without drafts, so once the prompts' greedy outputs are known (generated here
without speculation, the four prompts as one batch), a drafter's run is exact to replay without the model: at each
step the real `Drafter` (its back-off included) proposes from the tokens so far, the verification accepts the drafts
while they equal the output, and emits them plus the target's token. This counts plain steps (no draft) and
verification steps by rows, load-independent. Then one request's decode steps are timed with 1 + k rows forced
(spec_step_cost.py's drafter, the row counts interleaved step by step) and the expected ms per output token is
sum(steps x their measured cost) / tokens, against one plain step per token.

    python benchmarks/spec_replay.py [--arms ngram:4,ngram:8,suffix:4,suffix:8,suffix] [--rows 1,2,3,5,9,13,17]
        [--workload grounded|agentic|free] [--cost-ratios 1:1,5:1.7,9:2.47]

--cost-ratios: step costs relative to a plain step, by rows, given instead of timed (e.g. a quiet machine's, or the
coded GEMMs' from benchmarks/coded_rows.py), for a loaded machine where the timing is noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from spec_decode import AGENTIC, FREE, GROUNDED, arm_spec
from spec_step_cost import make_drafter

RESULTS = Path(__file__).parent / "results" / "spec_replay.jsonl"


def replay(spec: dict[str, Any], prompt: list[int], output: list[int], max_tokens: int) -> Counter[int]:
    """Steps by rows (1: a plain step) that `spec`'s drafter needs to emit `output` after `prompt`."""
    from engine_core.sampling_params import SamplingParams
    from engine_core.spec_decode.config import SpeculativeConfig
    from engine_core.spec_decode.drafter import Drafter

    config = SpeculativeConfig.parse(spec)
    assert config is not None
    drafter, params = Drafter(config), SamplingParams(temperature=0, max_tokens=max_tokens)
    steps: Counter[int] = Counter()
    n = 1  # the prefill emitted the first token
    while n < len(output):
        # NOTE: the scheduler's room: the drafts and the target's token stay within max_tokens.
        drafts = drafter.propose(0, prompt + output[:n], params, max_tokens - n - 1)
        a = 0
        while a < len(drafts) and n + a < len(output) and drafts[a] == output[n + a]:
            a += 1
        if drafts:
            drafter.record(0, len(drafts), a)
        steps[1 + len(drafts)] += 1
        n += a + 1
    return steps


def step_costs(llm: Any, prompt: list[int], rows: list[int], steps: int) -> dict[int, float]:
    """Median ms of a decode step of one sequence with `r` - 1 forced drafts, per r (interleaved step by step)."""
    from engine_core import SamplingParams
    from engine_core.core.request import Request

    core = llm.core
    drafters = {r: (make_drafter(r - 1) if r > 1 else None) for r in rows}
    params = SamplingParams(temperature=0, max_tokens=steps * len(rows) + 16, ignore_eos=True)
    core.add_request(Request("cost", list(prompt), params))
    core.step()
    times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(steps * len(rows) + len(rows)):
        r = rows[i % len(rows)]
        core.scheduler.drafter = drafters[r]
        t0 = time.perf_counter()
        core.step()
        if i >= len(rows):  # the first of each row count warms it
            times[r].append((time.perf_counter() - t0) * 1000)
    core.scheduler.drafter = None
    while core.has_unfinished:
        core.step()
    return {r: statistics.median(v) for r, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=1.25)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--arms", default="ngram:4,ngram:8,ngram:12,suffix:4,suffix:8,suffix")
    ap.add_argument("--rows", default="1,2,3,5,9,13,17", help="verification rows timed (1: a plain step)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per row count")
    ap.add_argument("--workload", choices=("grounded", "agentic", "free"), default="grounded")
    ap.add_argument("--cost-ratios", default="", help="rows:ratio,... instead of timing the steps")
    ap.add_argument("--ignore-eos", action="store_true", help="outputs run to max_tokens past EOS (spec_decode.py's)")
    args = ap.parse_args()
    from engine_core import LLM, SamplingParams

    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram"},  # NOTE: the drafter is swapped per measurement; off for the outputs
        num_threads=args.threads,
    )
    llm.core.scheduler.drafter = None
    prompts = [
        list(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in {"grounded": GROUNDED, "agentic": AGENTIC, "free": FREE}[args.workload]
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos),
        use_tqdm=False,
    )
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    if args.cost_ratios:
        cost = {int(r): float(c) for r, c in (item.split(":") for item in args.cost_ratios.split(","))}
        rows = sorted(cost)
    else:
        rows = [int(r) for r in args.rows.split(",")]
        cost = step_costs(llm, prompts[0], rows, args.steps)
    print("step ms by rows: " + ", ".join(f"{r}: {cost[r]:.2f} ({cost[r] / cost[1]:.2f}x)" for r in rows))

    def cost_of(r: int) -> float:  # between measured row counts: linear
        below = max(x for x in rows if x <= r)
        above = min((x for x in rows if x >= r), default=below)
        if above == below:
            return cost[below]
        return cost[below] + (cost[above] - cost[below]) * (r - below) / (above - below)

    tokens = sum(len(o) - 1 for o in outputs)
    result: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "workload": args.workload,
        "ignore_eos": args.ignore_eos,
        "cost_ms": cost,
        "tokens": tokens,
        "outputs": outputs,
    }
    print(f"{'arm':>10} {'plain':>6} {'verify':>6} {'rows/verify':>11} {'tokens/verify':>13} {'est. speedup':>12}")
    for arm in args.arms.split(","):
        steps: Counter[int] = Counter()
        for prompt, output in zip(prompts, outputs, strict=True):
            steps += replay(arm_spec(arm), prompt, output, args.max_tokens)
        verify = sum(c for r, c in steps.items() if r > 1)
        verify_rows = sum(r * c for r, c in steps.items() if r > 1)
        emitted_by_verify = tokens - steps[1]
        est = sum(cost_of(r) * c for r, c in steps.items())
        speedup = tokens * cost[1] / est
        print(
            f"{arm:>10} {steps[1]:>6} {verify:>6} {verify_rows / max(1, verify):>11.2f} "
            f"{emitted_by_verify / max(1, verify):>13.2f} {speedup:>11.2f}x"
        )
        result[arm] = {"steps_by_rows": dict(steps), "estimated_speedup": speedup}
    RESULTS.parent.mkdir(exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
