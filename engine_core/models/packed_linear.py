"""Projections with their weights pre-packed for oneDNN: the CPU float32 GEMM path.

NOTE: measured on the 2-core AVX2 EPYC over SmolLM2's 30 layers (benchmarks/gemm_bench.py): oneDNN with a weight
reordered once at load beats MKL's `F.linear` where decode lives — 18 vs 23 ms at 1 row, 28 vs 44 ms at 8 rows,
59 vs 72 ms at 32 rows, and the 49152-wide LM head 6 vs 16 ms at 8 rows — and is within 5 % of it at prefill sizes.
MKL re-packs the weight on every call and takes slow paths on this CPU for a handful of rows.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held as an opaque oneDNN tensor (the original weight is dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # NOTE: no batch-size hint: one layout serves every row count (a hint of 1 or 2048 was slower elsewhere).
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(module: nn.Module) -> None:
    """Replaces every `nn.Linear` below `module` with a `PackedLinear` holding the same weights."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
