"""CPU float32 GEMMs: the row thresholds of the dispatch (`CpuGemmRows`) that `model/layers/cpu_forms.cpu_gemm` and
the native decode step both follow.

A weight that is exactly GGUF blocks decoded (`coded_pack` finds and checks the codes) runs `coded_linear` on its
codes at every row count (CODED_M); other weights run the `panel_linear` kernel below ONEDNN_M, from ONEDNN_M rows
oneDNN with the weight packed at load, from LARGE_M rows MKL, only where it wins a one-time race against oneDNN
(`mkl_from_rows`). Without the native kernels every row count below `mkl_from_rows()` goes to oneDNN. Which forms a
weight keeps resident follows from these thresholds (`pack_forms`). The measurements behind the thresholds are in
docs/benchmarks.md, "CPU GEMMs by row count".
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu as cpu_kernels

NEVER = 1 << 62  # a row threshold no step reaches
# NOTE: a weight with codes keeps nothing else (no float32 panels, no oneDNN copy: -425 MB on the default model).
# Up to 16 rows (AVX-512; 4 on AVX2) the coded kernel decodes in registers, which beats float32 (the bytes streamed
# are the cost); above, it decodes each panel pair once into L2 and runs the panel kernel on it, the panel kernel's
# speed, within a few % of oneDNN at prefill sizes (docs/benchmarks.md, "CPU GEMMs by row count").
CODED_M = NEVER  # rows below which a weight with block codes runs the coded kernel: every row count
ONEDNN_M = 128  # rows from which oneDNN runs (below: the panel kernel)
LARGE_M = 512  # rows from which MKL runs, on CPUs where it beats oneDNN (`mkl_from_rows`)
_RACE_SHAPE = (1024, 576, 1536)  # rows, in, out: a prefill chunk through a SmolLM2-sized projection (~1.8 GFLOP)


@functools.cache
def mkl_from_rows() -> int:
    """Rows from which prefill-sized GEMMs go to MKL: LARGE_M where MKL wins a one-time race against oneDNN on this
    CPU (~0.1 s, once per process), else NEVER.

    NOTE: the winner depends on the machine. On an AVX2 EPYC MKL was 7-13 % faster at 2048 rows; on a Zen 4
    (AVX-512) EPYC oneDNN was 1.3-1.8x faster at 512 and 2048 rows over every SmolLM2 projection (MKL keeps generic
    code paths on non-Intel CPUs). oneDNN keeps ties.
    """
    rows, k, n = _RACE_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    best = {"mkl": float("inf"), "onednn": float("inf")}
    runs = {
        "mkl": lambda: nn.functional.linear(x, w),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    for _ in range(4):  # alternating, best of 4 (the first of each warms its code and buffers)
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return LARGE_M if best["mkl"] < 0.95 * best["onednn"] else NEVER


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


@dataclass(frozen=True)
class CpuGemmRows:
    """Row thresholds of the CPU float32 GEMM dispatch: rows below `coded_m` read a weight's block codes (where it
    has them), rows below `onednn_m` the panel kernel, rows from `onednn_m` oneDNN, rows from `large_m` MKL.

    A weight keeps only the forms some row count reaches (model/layers/cpu_forms.py): with the defaults, a weight
    with codes is resident as its codes alone, one without as panels + oneDNN; the plain float32 copy only where MKL
    runs.
    """

    coded_m: int
    onednn_m: int
    large_m: int
    a8_m: int = NEVER  # rows from which 4-bit codes run with 8-bit activations (quantization="gguf_a8": gguf_a8.py)

    @staticmethod
    def for_this_cpu() -> CpuGemmRows:
        """The defaults here: without the native kernels every row count below `mkl_from_rows()` goes to oneDNN,
        and codes run only with the vectorized coded kernel (the portable one is slower than float32)."""
        native = cpu_kernels.available()
        coded = native and cpu_kernels.coded_linear_vectorized()
        return CpuGemmRows(CODED_M if coded else 0, ONEDNN_M if native else 0, mkl_from_rows())
