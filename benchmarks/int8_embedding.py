"""The embedding lookup of an int8 model, float32 table against the LM head's int8 codes (`Int8Embedding`), per
token count: what reading a tied table from its codes costs a step (model/layers/int8_embedding.py).

Both on the default model's shape (49,152 x 576; random values: the cost does not depend on them), alternated in one
process, best of `--repeats` per round, microseconds a call:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_embedding.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine_core.model.layers.int8_embedding import Int8Embedding
from engine_core.model.layers.int8_gemm import quantize_per_channel

VOCAB, HIDDEN = 49152, 576


def best_us(fn: object, ids: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(ids)  # type: ignore[operator]
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,16,64,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    codes, scale = quantize_per_channel(table)
    arms = {"float32 table": torch.nn.Embedding.from_pretrained(table), "int8 codes": Int8Embedding(codes, scale)}
    counts = [int(n) for n in args.tokens.split(",")]
    print(f"{'tokens':>8}" + "".join(f"{name:>28}" for name in arms))
    with torch.no_grad():
        for n in counts:
            ids = torch.randint(0, VOCAB, (n,), generator=gen)
            runs: dict[str, list[float]] = {name: [] for name in arms}
            for _ in range(args.rounds):
                for name, module in arms.items():
                    runs[name].append(best_us(module, ids, args.repeats))
            print(f"{n:>8}" + "".join(f"{min(r):>14.1f}-{max(r):<13.1f}" for r in runs.values()))


if __name__ == "__main__":
    main()
