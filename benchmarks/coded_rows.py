"""The coded kernel's cost by row count on SmolLM2's projections (Q4_1 codes): what a verification step of 1 + k
query rows pays in the GEMMs against a one-token decode step.

For each row count M the whole layer's four projections (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down
576 x 1536) run through `coded_linear` in one call each (up to 16 rows: one register block, each record decoded
once), and, for comparison, as row blocks of at most 8 in separate calls (each block decodes every record again:
the kernel before its row blocks grew to 16). Calls alternate, best of --repeats.

    python benchmarks/coded_rows.py [--rows 1,2,5,9,13,16,17] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per projection of one SmolLM2 layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,5,8,9,13,16,17")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.available(), "needs the native CPU kernels"
    g = torch.Generator().manual_seed(0)
    weights = [
        (n, cpu_kernels.coded_pack(ref_gguf_decoded(torch.randn(n, k, generator=g) * 0.05, "q4_1"))) for n, k in SHAPES
    ]

    def layer(x_by_k: dict[int, list[torch.Tensor]]) -> None:
        for (n, records), (_, k) in zip(weights, SHAPES, strict=True):
            for x in x_by_k[k]:
                cpu_kernels.coded_linear(x, records, n, None)

    best: dict[tuple[int, str], float] = {}
    rows = [int(r) for r in args.rows.split(",")]
    inputs = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        inputs[(m, "one call")] = {k: [x] for k, x in xs.items()}
        inputs[(m, "blocks of 8")] = {k: list(x.split(8)) if m < 17 else [x] for k, x in xs.items()}
    for _ in range(args.repeats):
        for key, x_by_k in inputs.items():
            t0 = time.perf_counter()
            layer(x_by_k)
            best[key] = min(best.get(key, float("inf")), (time.perf_counter() - t0) * 1000)
    base = best[(rows[0], "one call")]
    print(f"{'rows':>4} {'one call ms':>12} {'x 1 row':>8} {'blocks of 8 ms':>15} {'x 1 row':>8}")
    for m in rows:
        one, eight = best[(m, "one call")], best[(m, "blocks of 8")]
        print(f"{m:>4} {one:>12.3f} {one / base:>7.2f}x {eight:>15.3f} {eight / base:>7.2f}x")


if __name__ == "__main__":
    main()
