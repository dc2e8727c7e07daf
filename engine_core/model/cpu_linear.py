"""CPU float32 projections: each GEMM goes to the implementation that is fastest for its row count.

Measured on the 2-core EPYC (Zen 4: AVX-512 for `-march=native`) over SmolLM2's 30 layers of projections and its
49152x576 LM head (`benchmarks/cpu_bench.py gemm`, ms; a shared machine, so +-5 %):

| rows | MKL `F.linear` | oneDNN, packed at load | `panel_linear` (kernels/cpu), packed at load |
| ---- | -------------- | ---------------------- | -------------------------------------------- |
| 1    | 35.8           | 22.3 (LM head 4.8)     | **14.0** (LM head **3.1**)                   |
| 4    | 48.6           | 17.9 (3.8)             | **14.2** (**3.3**)                           |
| 8    | 44.8           | 26.4 (4.9)             | **15.7** (**4.1**)                           |
| 16   | 53.5           | 27.3 (6.1)             | **21.6** (**5.2**)                           |
| 64   | 105.6          | 75.3 (17.8)            | **66.6** (17.8)                              |
| 128  | 175.7          | 136.4 (**33.5**)       | 135.1 (35.5)                                 |
| 256  | 312.4          | **255.4** (**79.9**)   | 264.5 (86.3)                                 |
| 2048 | 2714           | **2137** (621)         | 2214 (708)                                   |

(The streaming kernel it replaced at 1-4 rows: 17.6, 22.8 ms; LM head 3.9, 6.1.)

At 1-4 rows a projection streams the weight (the panel layout is one sequential stream per core); from ~16 rows
up it is compute bound, and the panel kernel's 12x32 register tile keeps the FMA units busy (~165-190 GFLOP/s).
From 128 rows oneDNN and the panel kernel are within the machine's noise on the layers (panel vs oneDNN in other
runs: 128 rows 143.3 vs 155.9 ms, 256: 285.6 vs 294.1, 192: 215.9 vs 201.4) and oneDNN wins the LM head by 6-8 %
(non-temporal stores of its 49152-wide output did not close that), so oneDNN keeps 128-511 rows.
From LARGE_M rows MKL runs only where it wins a race against oneDNN at load (`mkl_from_rows`; it lost here).

Below CODED_M rows, a weight that is exactly GGUF blocks decoded (the default model's layers are Q4_1, its tied
embedding Q8_0; `coded_pack` finds the codes and checks every weight) is read as its codes by `coded_linear`, which
gives the panel kernel's bits from 6 or 9 bits per weight instead of 32 (same benchmark, session 10, ms):

| rows | 30 layers: panel | coded    | LM head: panel | coded   |
| ---- | ---------------- | -------- | -------------- | ------- |
| 1    | 15.3             | **4.6**  | 3.0            | **1.0** |
| 4    | 13.8             | **5.9**  | 3.2            | **1.3** |
| 8    | 14.5             | **10.8** | 2.9            | 3.0     |
| 16   | 20.4             | 19.7     | 6.3            | 5.6     |
| 32   | 39.0             | 39.3     | 9.8            | 11.0    |
| 64   | 79.2             | 79.0     | 19.3           | 20.9    |

Each block of 8 rows decodes the weight again, so from ~16 rows the kernel is FMA-bound like the panel kernel, and
from 32 rows the float32 panels (kept for those rows) are as fast or faster.

NOTE: memory: three copies of each weight (plain for MKL and the tied embedding, oneDNN, panels): +0.5 GB for
SmolLM2 over the two before, and ~0.11 GB of code records where the weights have them; `onednn_from=None` drops
the oneDNN copy for at most ~5 % at 128-511 rows.
Without the native kernels every row count below `mkl_from_rows()` goes to oneDNN.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu as cpu_kernels

# NOTE: the codes serve every row count below oneDNN, so a weight with codes keeps no float32 panels beside them
# (-538 MB on the default model): they give the panel kernel's bits, as fast over the 30 layers at 32 and 64 rows
# (module docstring's table: 39.3 vs 39.0 ms, 79.0 vs 79.2), the LM head 8-12 % slower there (11.0 vs 9.8 ms).
CODED_M = 128  # rows below which a weight with block codes runs the coded kernel
ONEDNN_M = 128  # rows from which oneDNN runs (below: the panel kernel)
LARGE_M = 512  # rows from which MKL runs, on CPUs where it beats oneDNN (`mkl_from_rows`)
NEVER = 1 << 62  # a row threshold no step reaches
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
    with codes is resident as codes + oneDNN, one without as panels + oneDNN; the plain float32 copy only where MKL
    runs.
    """

    coded_m: int
    onednn_m: int
    large_m: int

    @staticmethod
    def for_this_cpu() -> CpuGemmRows:
        """The defaults here: without the native kernels every row count below `mkl_from_rows()` goes to oneDNN,
        and codes run only with the vectorized coded kernel (the portable one is slower than float32)."""
        native = cpu_kernels.available()
        coded = native and cpu_kernels.coded_linear_vectorized()
        return CpuGemmRows(CODED_M if coded else 0, ONEDNN_M if native else 0, mkl_from_rows())
