"""What a verification step of 1 + k query tokens costs against a plain one-token decode step, by part.

One request alone (greedy, an input-grounded prompt), its decode steps forced to carry k drafts each (the
sequence's last token repeated: almost always rejected, so every step verifies 1 + k rows and emits one token). For
each k the steps are timed whole and by the runner's phases (`ModelRunner.last_timings`): input preparation, the
forward (every decoder layer: the native decode step on CPU), and the rest (LM head over the 1 + k rows, sampling,
acceptance). The k values rotate step by step, so load changes on a shared machine hit every k alike.

    python benchmarks/spec_step_cost.py [--ks 0,4,8,16] [--steps 60] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from spec_decode import GROUNDED


def make_drafter(k: int) -> Any:
    """A drafter proposing `k` copies of the last token at every step (no back-off): every step verifies 1 + k."""
    from engine_core.spec_decode.config import SpeculativeConfig
    from engine_core.spec_decode.drafter import Drafter

    class FixedDrafter(Drafter):
        def propose(self, seq_id: int, token_ids: list[int], params: Any, room: int, *_: Any, **__: Any) -> list[int]:
            return [token_ids[-1]] * min(k, room)

        def record(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
            self.stats.record(num_draft, num_accepted)

    return FixedDrafter(SpeculativeConfig(method="ngram", num_speculative_tokens=max(1, k)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=1.25)
    ap.add_argument("--ks", default="0,4,8,16", help="draft lengths (0: plain decode steps)")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per k")
    args = ap.parse_args()
    from engine_core import LLM, SamplingParams
    from engine_core.core.request import Request

    ks = [int(k) for k in args.ks.split(",")]
    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=64,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        num_threads=args.threads,
    )
    core, runner = llm.core, llm.engine.runner
    drafters = {k: (make_drafter(k) if k else None) for k in ks}
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": GROUNDED[0]}], add_generation_prompt=True)
    parts: dict[int, dict[str, list[float]]] = {k: {"step": [], "prep": [], "forward": [], "rest": []} for k in ks}
    # NOTE: one long request (ignore_eos) per pass; within it the k rotates step by step.
    max_tokens = args.steps * len(ks) + 8
    core.scheduler.drafter = None
    core.add_request(Request("cost", list(ids), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    core.step()  # prefill
    for _ in range(4):  # warm-up of every k's shapes
        for k in ks:
            core.scheduler.drafter = drafters[k]
            core.step()
    i = 0
    while core.has_unfinished and i < args.steps * len(ks):
        k = ks[i % len(ks)]
        core.scheduler.drafter = drafters[k]
        t0 = time.perf_counter()
        core.step()
        dt = time.perf_counter() - t0
        t = runner.last_timings
        if t.forward_start:
            parts[k]["step"].append(dt * 1000)
            parts[k]["prep"].append((t.forward_start - t.start) * 1000)
            parts[k]["forward"].append((t.sample_start - t.forward_start) * 1000)
            parts[k]["rest"].append((t.end - t.sample_start) * 1000)
        i += 1
    core.scheduler.drafter = None
    while core.has_unfinished:
        core.step()
    base = statistics.median(parts[ks[0]]["step"])
    print(f"{'k':>3} {'rows':>4} {'step ms':>8} {'/k=' + str(ks[0]):>7} {'prep':>6} {'forward':>8} {'rest':>6}")
    for k in ks:
        med = {name: statistics.median(v) for name, v in parts[k].items()}
        print(
            f"{k:>3} {k + 1:>4} {med['step']:>8.2f} {med['step'] / base:>6.2f}x {med['prep']:>6.2f} "
            f"{med['forward']:>8.2f} {med['rest']:>6.2f}"
        )


if __name__ == "__main__":
    main()
