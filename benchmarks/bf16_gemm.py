"""bf16 GEMMs by row count on SmolLM2's projections and LM head: oneDNN (`_linear_pointwise` on the
`_reorder_linear_weight` form, as model/layers/cpu_forms.py ran it, with and without a batch-size hint) against the
native AVX-512 BF16 kernel (`bf16_linear` on `bf16_pack` panels), bf16 in and bf16 out, on 1 and 2 threads.

Weights are cache-cold as in a decode step: each call reads the next of --layers distinct copies of the weight (30
layers' worth by default; SmolLM2-135M's are ~7 MB a layer in bf16, against 32 MB of L3). The arms alternate within
each repeat; the best repeat counts. Prints ms per call and GFLOP/s.

    python benchmarks/bf16_gemm.py [--rows 8,16,32,48,64,128,2048] [--threads 1,2] [--arms onednn,hint,native]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import cpu as cpu_kernels

# (name, out, in): one SmolLM2 layer's projections, and the tied LM head
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def arms(weights: list[torch.Tensor], m: int, names: list[str]) -> dict[str, Callable[[torch.Tensor, int], object]]:
    """Each arm's call on x through copy i of the weight (its form packed here, once)."""
    n = weights[0].shape[0]
    made: dict[str, Callable[[torch.Tensor, int], object]] = {}
    if "onednn" in names:
        plain = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
        made["onednn"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, plain[i], None, "none", [], "")
    if "hint" in names:
        hinted = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        made["hint"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, hinted[i], None, "none", [], "")
    if "native" in names:
        panels = [cpu_kernels.bf16_pack(w) for w in weights]
        made["native"] = lambda x, i: cpu_kernels.bf16_linear(x, panels[i], n, None, torch.bfloat16)
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,16,32,48,64,128,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--arms", default="onednn,hint,native")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--layers", type=int, default=30, help="distinct weight copies cycled through (2 for the LM head)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    assert cpu_kernels.available() and cpu_kernels.bf16_linear_native(), "needs the native kernels with AVX-512 BF16"
    names = args.arms.split(",")
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':>8} {'rows':>5} {'thr':>3} " + " ".join(f"{a + ' ms':>11} {'GF/s':>5}" for a in names))
    for shape, n, k in SHAPES:
        if shape not in args.shapes.split(","):
            continue
        copies = 2 if shape == "lm_head" else args.layers
        weights = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g).bfloat16()
            made = arms(weights, m, names)
            calls = copies if m * n * k < 1 << 30 else min(copies, 2)  # prefill-sized: compute-bound, fewer calls
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                best = dict.fromkeys(made, float("inf"))
                for _ in range(args.repeats):
                    for name, run in made.items():
                        run(x, 0)  # warm the code path, not the weights (copy 0 is evicted by the rest)
                        t0 = time.perf_counter()
                        for i in range(1, calls):
                            run(x, i)
                        best[name] = min(best[name], (time.perf_counter() - t0) / max(1, calls - 1))
                cells = " ".join(f"{best[a] * 1e3:>11.3f} {2 * m * n * k / best[a] / 1e9:>5.0f}" for a in made)
                print(f"{shape:>8} {m:>5} {threads:>3} {cells}", flush=True)
    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))


if __name__ == "__main__":
    main()
