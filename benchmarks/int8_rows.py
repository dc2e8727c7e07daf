"""int8 GEMMs per row count against bf16 / float32 oneDNN on one SmolLM2 projection: the native int8 kernels
(kernels/cpu/int8_ops.cpp: `wo` weight-only, `w8a8`) beside torch's (`_weight_int8pack_mm` with bf16 x, and `_int_mm`
between torch passes over x and the product, as `quantization="int8"` ran before the native ops).

Timed in CPU time (`time.process_time`, 1 thread, best of 3 runs of N calls), which a shared machine inflates far
less than wall time; the weight (<= 2 MB of int8) stays in the caches, so this is the kernels' compute, not batch 1's
DRAM stream (benchmarks/batch1_roofline.py measures that).

    PYTHONPATH=$PWD python benchmarks/int8_rows.py [--shape 576 1536] [--rows 1 4 16 64 256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, default=[576, 1536], metavar=("IN", "OUT"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    args = ap.parse_args()

    from engine_core.model.layers import int8_gemm
    from kernels import cpu as cpu_kernels

    torch.set_num_threads(1)
    if not cpu_kernels.available():
        raise SystemExit("the native CPU kernels are unavailable here")
    k, n = args.shape
    torch.manual_seed(0)
    codes, scale = int8_gemm.quantize_per_channel(torch.randn(n, k))
    w = codes.float() * scale[:, None]
    bf16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None)
    f32 = torch.ops.mkldnn._reorder_linear_weight(w, None)
    any_rows = int8_gemm.Int8Weight(codes, scale, 0)
    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "fp32": lambda x: torch.ops.mkldnn._linear_pointwise(x, f32, None, "none", [], ""),
        "bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), bf16, None, "none", [], "").float(),
        "torch wo": lambda x: int8_gemm._torch_weight_only(any_rows, x),
        "torch w8a8": lambda x: int8_gemm._torch_w8a8(any_rows, x),
        "wo": lambda x: cpu_kernels.int8_linear(x, codes, scale, None, 1 << 62),
        "w8a8": lambda x: cpu_kernels.int8_linear(x, codes, scale, None, 0),
    }
    print(f"| rows ({k} -> {n}) | " + " | ".join(ops) + " |   (us of CPU time per call, 1 thread)")
    print("| ---: |" + " ---: |" * len(ops))
    with torch.inference_mode():
        for m in args.rows:
            x = torch.randn(m, k)
            calls = max(5, 2000 // m)
            best = {}
            for name, op in ops.items():
                op(x)  # warm
                runs = []
                for _ in range(3):
                    t0 = time.process_time()
                    for _ in range(calls):
                        op(x)
                    runs.append((time.process_time() - t0) / calls)
                best[name] = min(runs)
            print(f"| {m} | " + " | ".join(f"{best[name] * 1e6:.1f}" for name in ops) + " |", flush=True)


if __name__ == "__main__":
    main()
