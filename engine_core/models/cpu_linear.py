"""CPU float32 projections: each GEMM goes to the implementation that is fastest for its row count.

Measured on the 2-core AVX2 EPYC over SmolLM2's 30 layers of projections (`benchmarks/cpu_bench.py gemm`):

| rows | MKL `F.linear` | oneDNN, weight packed at load | `small_m_linear` (kernels/cpu) |
| ---- | -------------- | ----------------------------- | ------------------------------ |
| 1    | 26.9 ms        | 17.9 ms                       | **15.6 ms** (LM head 3.3 vs 4.1) |
| 8    | 46.6 ms        | **28.5 ms**                   | 28.2 ms (LM head 7.0 vs 5.9)   |
| 64   | 113.7 ms       | **102.2 ms**                  |                                |
| 2048 | **2.39 s**     | 2.70 s                        |                                |

A handful of rows is a weight-streaming problem (the native kernel streams the 425 MB at ~27 GB/s, oneDNN at
~24); mid sizes are where MKL re-packs the weight on every call and takes slow paths on this CPU; at prefill sizes
MKL's packing cost is amortised and its kernels are the fastest. NOTE: this keeps two copies of each weight (plain
and packed): +100 % weight memory, 0.5 GB for SmolLM2, bought for the numbers above.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu as cpu_kernels

SMALL_M = 4  # rows at or below which the streaming kernel runs
LARGE_M = 512  # rows from which MKL runs


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class CpuLinear(nn.Module):
    """`y = x @ W.T + b`, dispatched by row count; see the module docstring."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.weight = weight.detach().contiguous()
            # NOTE: no batch-size hint: one layout serves every row count (a hint of 1 or 2048 was slower elsewhere).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.streaming = cpu_kernels.available()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= SMALL_M and self.streaming:
            return cpu_kernels.small_m_linear(x, self.weight, self.bias)
        if rows >= LARGE_M:
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_cpu_linears(module: nn.Module) -> None:
    """Replaces every `nn.Linear` below `module` with a `CpuLinear` holding the same weights."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, CpuLinear(child.weight, child.bias))
        else:
            use_cpu_linears(child)
