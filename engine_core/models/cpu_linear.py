"""CPU float32 projections: each GEMM goes to the implementation that is fastest for its row count.

Measured on the 2-core EPYC (Zen 4: AVX-512 for `-march=native`) over SmolLM2's 30 layers of projections and its
49152x576 LM head (`benchmarks/cpu_bench.py gemm`, ms; a shared machine, so +-5 %):

| rows | MKL `F.linear` | oneDNN, packed at load | `small_m_linear` | `panel_linear` (kernels/cpu), packed at load |
| ---- | -------------- | ---------------------- | ---------------- | -------------------------------------------- |
| 1    | 36.4           | 23.5 (LM head 5.5)     | 21.6 (5.3)       | **16.7** (LM head **3.6**)                   |
| 4    | 60.2           | 26.1 (5.2)             | 25.3 (8.8)       | **16.4** (**4.2**)                           |
| 8    | 51.9           | 27.8 (5.7)             | 33.2 (8.8)       | **19.6** (**4.7**)                           |
| 16   | 64.9           | 32.5 (7.4)             |                  | **29.3** (**7.1**)                           |
| 64   | 156.5          | 86.5 (19.5)            |                  | **70.8** (18.4)                              |
| 256  | 473.7          | 294.1 (**86.2**)       |                  | **285.6** (93.2)                             |
| 2048 | 2636 (docs: 2390 on a quiet run) | 2060 (713) |           | 2266 (742)                                   |

At 1-4 rows a projection streams the weight (the panel layout is one sequential stream per core); from ~16 rows
up it is compute bound, and the panel kernel's 12x32 register tile keeps the FMA units busy (~165-190 GFLOP/s).
At prefill sizes MKL takes over (its packing cost amortised; not re-measured here, the docs' quiet run favours it).
The LM head alone keeps a oneDNN copy for 128-511 rows, where oneDNN measured 2-8 % faster (writing the 49152-wide
output is its cost there). NOTE: memory: plain weight (MKL, and the tied embedding) + panel copy per projection, as
before with the oneDNN copy; the LM head has both packed copies (+113 MB for SmolLM2). Without the native kernels
every row count below LARGE_M goes to oneDNN, as it did before the panel kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu as cpu_kernels

LARGE_M = 512  # rows from which MKL runs; below: the panel kernel (or oneDNN, see LM_HEAD_ONEDNN_M)
LM_HEAD_ONEDNN_M = 128  # the LM head's rows from which oneDNN runs (up to LARGE_M)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class CpuLinear(nn.Module):
    """`y = x @ W.T + b`, dispatched by row count; see the module docstring.

    `onednn_from`: rows (below LARGE_M) from which oneDNN runs instead of the panel kernel; None: never.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn_from: int | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        native = cpu_kernels.available()
        self.onednn_from = onednn_from if native else 0
        with torch.no_grad():
            self.weight = weight.detach().contiguous()
            self.panels = cpu_kernels.panel_pack(self.weight) if native else None
            # NOTE: no batch-size hint: one layout serves every row count (a hint of 1 or 2048 was slower elsewhere).
            self.packed = (
                None if self.onednn_from is None else torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            )
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= LARGE_M:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.onednn_from is not None and rows >= self.onednn_from:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.stride(-1) != 1:
            x = x.contiguous()
        return cpu_kernels.panel_linear(x, self.panels, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_cpu_linears(module: nn.Module) -> None:
    """Replaces every `nn.Linear` below `module` with a `CpuLinear` holding the same weights."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child.weight, child.bias))
        else:
            use_cpu_linears(child)
