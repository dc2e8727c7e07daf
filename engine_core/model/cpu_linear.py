"""CPU float32 projections: each GEMM goes to the implementation that is fastest for its row count.

Below CODED_M rows a weight that is exactly GGUF blocks decoded (`coded_pack` finds and checks the codes) runs
`coded_linear` on its codes, other weights the `panel_linear` kernel; from ONEDNN_M rows oneDNN with the weight packed
at load; from LARGE_M rows MKL, only where it wins a one-time race against oneDNN (`mkl_from_rows`). Without the
native kernels every row count below `mkl_from_rows()` goes to oneDNN. The measurements behind the thresholds are in
docs/benchmarks.md, "CPU GEMMs by row count".

NOTE: memory: three copies of each weight (plain for MKL and the tied embedding, oneDNN, panels): +0.5 GB for
SmolLM2 over the two before, and ~0.11 GB of code records where the weights have them; `onednn_from=None` drops
the oneDNN copy for at most ~5 % at 128-511 rows.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from kernels import cpu as cpu_kernels

CODED_M = 32  # rows below which a weight with block codes runs the coded kernel
ONEDNN_M = 128  # rows from which oneDNN runs (below: the panel kernel)
LARGE_M = 512  # rows from which MKL runs, on CPUs where it beats oneDNN (`mkl_from_rows`)
NEVER = 1 << 62  # a row threshold no step reaches
_RACE_SHAPE = (1024, 576, 1536)  # rows, in, out: a prefill chunk through a SmolLM2-sized projection (~1.8 GFLOP)


@functools.cache
def mkl_from_rows() -> int:
    """Rows from which prefill-sized GEMMs go to MKL: LARGE_M where MKL wins a one-time race against oneDNN on this
    CPU (~0.1 s, once per process), else NEVER.

    NOTE: the winner depends on the machine. On an AVX2 EPYC MKL was 7-13 % faster at 2048 rows;
    on a Zen 4 (AVX-512) EPYC oneDNN was 1.3-1.8x faster at 512 and 2048 rows over every SmolLM2
    projection (MKL keeps generic code paths on non-Intel CPUs). oneDNN keeps ties: its copy of the weight exists
    anyway.
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


class CpuLinear(nn.Module):
    """`y = x @ W.T + b`, dispatched by row count; see the module docstring.

    `onednn_from`: rows (below LARGE_M) from which oneDNN runs instead of the panel kernel; None: never (and no
    oneDNN copy of the weight).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn_from: int | None = ONEDNN_M) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        native = cpu_kernels.available()
        self.onednn_from = onednn_from if native else 0
        with torch.no_grad():
            self.weight = weight.detach().contiguous()
            self.panels = cpu_kernels.panel_pack(self.weight) if native else None
            self.coded = (
                cpu_kernels.coded_pack(self.weight) if native and cpu_kernels.coded_linear_vectorized() else None
            )
            # NOTE: no batch-size hint: one layout serves every row count (a hint of 1 or 2048 was slower elsewhere).
            self.packed = (
                None if self.onednn_from is None else torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            )
        self.bias = None if bias is None else bias.detach().contiguous()
        self.mkl_from = mkl_from_rows() if self.packed is not None else LARGE_M

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= self.mkl_from:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.onednn_from is not None and rows >= self.onednn_from:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.coded is not None and rows < CODED_M:
            return cpu_kernels.coded_linear(x, self.coded, self.out_features, self.bias)
        return cpu_kernels.panel_linear(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        coded = "" if self.coded is None else f", coded={self.coded.shape[2]}B/record"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{coded}"


def use_cpu_linears(module: nn.Module) -> None:
    """Replaces every `nn.Linear` below `module` with a `CpuLinear` holding the same weights."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child.weight, child.bias))
        else:
            use_cpu_linears(child)
