"""Where a batch-1 token's time goes through `LLM.generate`: wall and CPU time per phase of a decode step.

The engine's own calls are wrapped with timers (each a perf_counter and a thread_time reading on entry and exit, ~1
us): the engine step, the model runner's execute and its parts (the persistent batch's input preparation, attention
metadata, the embedding lookup, the native decode step over every layer, the final norm, the LM head, sampling),
the scheduler and the output processing. Like `offline_run.batch1`, a 1-token call is subtracted from a
`--tokens + 1`-token call on the same prompt, so prefill and the call's fixed costs cancel out, and each phase is
reported per decode token.

CPU time is the calling thread's (`time.thread_time`): on a shared machine it is far steadier than wall time, but
with `--threads 2` it also counts the main thread's OpenMP spinning at the end of each parallel region, so read the
CPU columns at `--threads 1`, the wall columns on a quiet machine.

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/batch1_split.py [--quantization int8] [--dtype bfloat16]
        [--threads 2] [--tokens 128] [--rounds 3] [--unfused-head]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workload import BATCH1_TOKENS, batch1_prompt


@dataclass
class Phase:
    wall_s: float = 0.0
    cpu_s: float = 0.0
    calls: int = 0


class Timers:
    """Named phases, each the sum over the calls of the functions wrapped into it."""

    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)
        phase = self.phases.setdefault(name, Phase())

        def timed(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                phase.wall_s += time.perf_counter() - w0
                phase.cpu_s += time.thread_time() - c0
                phase.calls += 1

        setattr(owner, attr, timed)

    def snapshot(self) -> dict[str, Phase]:
        return {k: Phase(v.wall_s, v.cpu_s, v.calls) for k, v in self.phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=BATCH1_TOKENS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--unfused-head", action="store_true", help="the LM head as its own call (int8: head_step.py)")
    args = ap.parse_args()

    import engine_core.worker.model_runner as model_runner
    from engine_core import LLM, SamplingParams
    from engine_core.model.native_decode import NativeDecodeStep
    from kernels import cpu as cpu_kernels

    torch.set_num_threads(args.threads)
    llm = LLM(kv_cache_memory=0.25, num_threads=args.threads, dtype=args.dtype, quantization=args.quantization)
    core = llm.core
    runner = core.executor
    if not isinstance(runner, model_runner.ModelRunner):
        raise SystemExit("needs the in-process model runner (tensor_parallel_size=1)")
    model = runner.model
    if args.unfused_head and isinstance(runner.decode_step, NativeDecodeStep):
        runner.decode_step.head = None
    timers = Timers()
    # NOTE: wrapped where the caller looks the name up (module globals, instance attributes), so no engine code
    # changes; execute() first, so that its parts nest inside it.
    for owner, attr, name in [
        (core, "step", "engine step"),
        (core.scheduler, "schedule", "  scheduler.schedule"),
        (core, "process", "  engine process (outputs, stops)"),
        (runner, "execute", "  model runner execute"),
        (runner.batch, "prepare", "    input batch prepare"),
        (model_runner, "attention_metadata", "    attention metadata"),
        (model.embed_tokens, "forward", "    embedding"),
        (model.rotary, "lookup", "    rotary cos/sin lookup"),
        (cpu_kernels, "decode_layers", "    native decode step (30 layers)"),
        (cpu_kernels, "decode_int8_head", "    native step + LM head (+ pick)"),
        (model.norm, "forward", "    final norm"),
        (model, "compute_logits", "    LM head"),
        (model_runner, "sample_on_driver", "    sampling (+ host copy)"),
        (model_runner, "picked_step", "    fused pick's tokens (host copy)"),
        (runner.batch, "advance", "    input batch advance"),
    ]:
        timers.wrap(owner, attr, name)

    prompt = batch1_prompt()

    def generate(n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False)

    generate(4)  # warm-up
    for rnd in range(args.rounds):
        before = timers.snapshot()
        w0, c0 = time.perf_counter(), time.thread_time()
        generate(1)
        w1, c1 = time.perf_counter(), time.thread_time()
        mid = timers.snapshot()
        generate(args.tokens + 1)
        w2, c2 = time.perf_counter(), time.thread_time()
        after = timers.snapshot()
        n = args.tokens
        wall = ((w2 - w1) - (w1 - w0)) / n * 1e3
        cpu = ((c2 - c1) - (c1 - c0)) / n * 1e3
        print(f"round {rnd + 1}: {wall:.3f} ms/token wall, {cpu:.3f} ms main-thread CPU")
        print(f"  {'phase':40s} {'wall ms':>8s} {'CPU ms':>8s}")
        for name, end in after.items():
            one = Phase(mid[name].wall_s - before[name].wall_s, mid[name].cpu_s - before[name].cpu_s)
            many = Phase(end.wall_s - mid[name].wall_s, end.cpu_s - mid[name].cpu_s)
            print(f"  {name:40s} {(many.wall_s - one.wall_s) / n * 1e3:8.3f} {(many.cpu_s - one.cpu_s) / n * 1e3:8.3f}")


if __name__ == "__main__":
    main()
