"""Where a CPU step's time goes, per kind of step and per part, for one `LLM` configuration (e.g. `dtype`).

Runs `LLM.generate` over the 64-request random workload (workload.py) and reads every step's `StepTimings`:
prefill-carrying steps against decode-only steps (by row count), each split into input preparation, forward, and
LM head + sampling. Then it replays one recorded prefill-carrying step and one decode-only step of the most rows
through the layer loop under torch.profiler (the native ops are dispatched from Python there, so each is a row),
and times the same decode step through the runner's native whole-step decode.

    PYTHONPATH=$PWD python benchmarks/cpu_step_profile.py [--dtype bfloat16] [--engine-args '{"kv_cache_dtype": ...}']

NOTE: the replayed steps rewrite the K/V they wrote in the run (the same values), so the cache stays valid.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from workload import make_workload

from engine_core.attention.backend import AttentionMetadata


@dataclasses.dataclass
class Recorded:
    """One forward's inputs, cloned for a replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def _clone(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> Recorded:
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    meta = AttentionMetadata(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in fields.items()})
    return Recorded(ids.clone(), pos.clone(), meta)


def _profile(fn: object, repeats: int) -> list[tuple[str, float, int]]:
    """(op, ms per call of fn, calls per call of fn) for the ops of fn, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()  # type: ignore[operator]
    rows = [(e.key, e.self_cpu_time_total / 1000 / repeats, e.count // repeats) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine-args", default="{}", help="JSON: more LLM(...) arguments")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=0, help="cap each request's output (0: the workload's)")
    ap.add_argument("--repeats", type=int, default=3, help="replays of each recorded step")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()

    from engine_core import LLM, SamplingParams

    llm = LLM(None, dtype=args.dtype, kv_cache_memory=2.0, **json.loads(args.engine_args))
    runner = llm.engine.runner
    wl = make_workload(args.requests, 0)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    if args.max_tokens:
        params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True) for _ in params]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up

    steps: list[tuple[int, int, float, float, float]] = []  # tokens, decodes, prepare, forward, sample (s)
    recorded: dict[str, Recorded] = {}
    execute = runner.execute

    # NOTE: the inputs are recorded where the runner hands them to the device (`_to_device`), the meta at prepare.
    to_device = runner._to_device

    def recording_to_device(name: str, array: object) -> torch.Tensor:
        tensor = to_device(name, array)
        if name == "input_ids":
            runner._last_ids = tensor
        elif name == "positions":
            runner._last_pos = tensor
        return tensor

    def prepare_hook(meta: AttentionMetadata, prepare=runner.backend.prepare) -> None:
        kind = "prefill" if meta.num_prefills else "decode"
        best = recorded.get(kind)
        if best is None or meta.num_tokens >= best.meta.num_tokens:
            recorded[kind] = _clone(runner._last_ids, runner._last_pos, meta)
        steps.append((meta.num_tokens, meta.num_decodes, 0.0, 0.0, 0.0))
        prepare(meta)

    def run_step(plan: object) -> object:
        out = execute(plan)
        t = runner.last_timings
        if t.forward_start and steps:
            tokens, decodes = steps[-1][:2]
            steps[-1] = (
                tokens,
                decodes,
                t.forward_start - t.start,
                t.sample_start - t.forward_start,
                t.end - t.sample_start,
            )
        return out

    runner._to_device = recording_to_device
    runner.backend.prepare = prepare_hook
    runner.execute = run_step
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    runner.execute = execute
    del runner.backend.prepare, runner._to_device
    print(
        f"{args.dtype} {args.engine_args}: {wl.total_tokens / wall:.1f} total tok/s ({wall:.1f} s), "
        f"load average {os.getloadavg()[0]:.2f}"
    )

    classes: dict[str, list[tuple[int, int, float, float, float]]] = defaultdict(list)
    for s in steps:
        tokens, decodes = s[:2]
        if tokens > decodes:
            classes["prefill-carrying"].append(s)
        else:
            classes[f"decode {1 << (decodes.bit_length() - 1)}-{(1 << decodes.bit_length()) - 1} rows"].append(s)
    print("| steps | count | total s | prepare ms | forward ms | LM head + sampling ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in sorted(classes, key=lambda k: (k != "prefill-carrying", len(k), k)):
        rows = classes[name]
        total = sum(r[2] + r[3] + r[4] for r in rows)
        med = [statistics.median(r[i] for r in rows) * 1000 for i in (2, 3, 4)]
        print(f"| {name} | {len(rows)} | {total:.2f} | {med[0]:.2f} | {med[1]:.1f} | {med[2]:.2f} |")
    print(f"all steps {sum(r[2] + r[3] + r[4] for r in steps):.2f} s of {wall:.2f} s wall")

    model, kv = runner.model, runner.kv_caches
    with torch.inference_mode():
        for kind, rec in sorted(recorded.items()):
            meta = rec.meta
            runner.backend.prepare(meta)
            last = torch.arange(meta.num_tokens)[-min(meta.num_tokens, 64) :] if kind == "prefill" else None

            def loop(rec: Recorded = rec, last: torch.Tensor | None = last) -> None:
                h = model.forward(rec.input_ids, rec.positions, kv, rec.meta)
                model.compute_logits(h if last is None else h[last])

            loop()
            print(f"\n{kind} step, {meta.num_tokens} tokens ({meta.num_decodes} decodes), layer loop + LM head:")
            ops = _profile(loop, args.repeats)
            total = sum(r[1] for r in ops)
            print(f"| op | ms | calls | share | (total {total:.1f} ms)")
            print("| --- | ---: | ---: | ---: |")
            for key, ms, calls in ops[: args.top]:
                print(f"| {key} | {ms:.2f} | {calls} | {ms / total:.1%} |")
            if kind == "decode" and runner.decode_step is not None:
                step = runner.decode_step
                times = []
                for _ in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    h = step(rec.input_ids, rec.positions, kv, meta)
                    t1 = time.perf_counter()
                    model.compute_logits(h)
                    times.append((t1 - t0, time.perf_counter() - t1))
                best = min(times)
                print(f"native decode step: layers {best[0] * 1000:.1f} ms, LM head {best[1] * 1000:.1f} ms")


if __name__ == "__main__":
    main()
