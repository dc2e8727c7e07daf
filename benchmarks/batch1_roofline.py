"""Batch-1 decode against the bytes of weight it must read: ms/token of each weight format through `LLM.generate`
beside the time its resident linear weights take to stream at the read bandwidth measured in the same run.

Each format's `LLM` is built in turn (2 threads), then the bandwidth probe (a sum over a 1 GiB float32 buffer, the
same threads, best of 5) and each format's batch-1 decode are alternated for `--rounds`, so both sides of the ratio
see the same machine load. The floor is `resident weight bytes / bandwidth` (every linear, the LM head included;
attention's few KB of K/V and the one embedding row are left out); the target for int8 and bf16 is <= 1.2x it.

    PYTHONPATH=$PWD python benchmarks/batch1_roofline.py [--formats float32,bfloat16,int8,gguf_a8] [--rounds 3]
        [--model DIR]

`--formats int8,int8-unfused-head` runs the int8 model twice, the second with its LM head as its own call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline_run import batch1  # the same batch-1 measurement as the side-by-side's

FORMATS = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "gguf_a8": {"quantization": "gguf_a8"},
}
# NOTE: the same int8 engine with its LM head as its own call (worker/head_step.py off), for an A/B in one process
UNFUSED_HEAD = "int8-unfused-head"


def read_bandwidth_gbs(buffer: torch.Tensor, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - t0)
    return buffer.numel() * buffer.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="float32,bfloat16,int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="an HF directory or .gguf (default: SmolLM2-135M-Instruct's GGUF)")
    args = ap.parse_args()

    from engine_core import LLM, SamplingParams
    from engine_core.model.layers.linear import Linear
    from engine_core.model.native_decode import NativeDecodeStep

    torch.set_num_threads(args.threads)
    engines = {}
    for name in args.formats.split(","):
        kwargs = FORMATS["int8" if name == UNFUSED_HEAD else name]
        llm = LLM(args.model, kv_cache_memory=0.25, num_threads=args.threads, **kwargs)
        model = llm.core.executor.model
        if name == UNFUSED_HEAD and isinstance(llm.core.executor.decode_step, NativeDecodeStep):
            llm.core.executor.decode_step.head = None
        weight_bytes = sum(m.resident_bytes() for m in model.modules() if isinstance(m, Linear))

        def generate(prompts: list[list[int]], lens: list[int], llm: LLM = llm) -> int:
            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        generate([[1, 2, 3]], [4])  # warm-up
        engines[name] = (generate, weight_bytes)
    buffer = torch.ones(1 << 28)  # 1 GiB: far past the caches
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        for name, (generate, weight_bytes) in engines.items():
            gbs = read_bandwidth_gbs(buffer)
            (ms,) = batch1(generate, 1)
            floor = weight_bytes / (gbs * 1e9) * 1e3
            results[name].append((ms, floor))
            print(
                f"round {rnd + 1} {name:9s} {ms:6.2f} ms/token; weights {weight_bytes / 1e6:6.1f} MB at "
                f"{gbs:5.1f} GB/s = {floor:5.2f} ms floor; {ms / floor:4.2f}x",
                flush=True,
            )
    print("| format | linear weights, MB | batch 1, ms/token (best) | floor at the run's bandwidth, ms | x |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        ms, floor = min(rows)
        print(f"| {name} | {engines[name][1] / 1e6:.1f} | {ms:.2f} | {floor:.2f} | {ms / floor:.2f}x |")


if __name__ == "__main__":
    main()
