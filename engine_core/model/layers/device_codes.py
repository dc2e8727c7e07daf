"""A linear weight as the coded Triton GEMM reads it on the GPU (kernels/triton/coded_matmul.py; kept by
cuda_codes.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceCodes:
    """A weight `[N, K]` as `coded_matmul` reads it: int8 codes `[N, K]` (`packed`: 4-bit codes two a byte, `[N, K / 2]`
    uint8), float32 scales `[N, K // group]` (offsets alike or None), or with `group` 0 one scale per output channel
    `[N]`."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group: int
    packed: bool = False

    def nbytes(self) -> int:
        parts = (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)
