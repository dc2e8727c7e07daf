"""A weight as the GGUF file holds it: integer codes with a scale (and an offset) per group of k, kept as codes.

`coded_pack` (kernels/cpu/coded_linear.cpp) finds the legacy formats' codes (Q4_0 ... Q8_0) from the float32
weight alone; the K-quants' scales are products of a super-block scale and a 6-bit sub-block scale that cannot be
recovered from the decoded values, so the loader hands their codes over as read (model/gguf_kquants.py) and
`records` lays them out for `coded_linear`:
- Q4_K / Q5_K: 32-weight groups, w = fma(d, q, m) with q in 0..15 / 0..31: the 4-bit / 8-bit records;
- Q6_K: 16-weight groups, w = d * q with q in -32..31: the two-halves records `[P, K/32, 2, 384]` (m = 0); a fused
  projection whose shards mix layouts (Q4_K q / k beside a Q6_K v) has every shard in the widest (`cat_rows`).
`values()` is the float32 weight with the same operations (what transformers makes of the file: gguf-py's decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PANEL = 16  # output columns per record (coded_linear.cpp's kCols)
BLOCK = 32  # k per record (kBlock)


@dataclass(frozen=True)
class BlockCodes:
    """`[rows, K]` weights, w = fma(scales, q, offsets) per `group` k (offsets None: w = scales * q)."""

    scales: torch.Tensor  # [rows, K // group] float32
    offsets: torch.Tensor | None  # [rows, K // group] float32
    q: torch.Tensor  # [rows, K] int8 (Q4_K: 0..15, Q5_K: 0..31, Q6_K: -32..31)
    group: int  # 32 (with offsets) or 16 (without)
    bits: int  # 4 or 8 bits per code in the records

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def values(self) -> torch.Tensor:
        """The float32 weights: d * q exact in float32 (a 17-19-bit scale times a 4-6-bit code), + m rounded once."""
        rows, k = self.shape
        q = self.q.float().view(rows, -1, self.group)
        d = self.scales.unsqueeze(-1)
        w = d * q if self.offsets is None else torch.addcmul(self.offsets.unsqueeze(-1), d, q)
        return w.view(rows, k)

    def rows(self, index: torch.Tensor) -> BlockCodes:
        """The codes of rows `index` in that order (llama.cpp's Q/K row permutation undone)."""
        offsets = None if self.offsets is None else self.offsets[index]
        return BlockCodes(self.scales[index], offsets, self.q[index], self.group, self.bits)

    def records(self) -> torch.Tensor:
        """`coded_linear`'s records: `[P, K/32, R]` (R = 384 for 4 bits, 640 for 8) or `[P, K/32, 2, 384]`."""
        rows, k = self.shape
        panels, blocks = -(-rows // PANEL), k // BLOCK
        pad = panels * PANEL - rows  # NOTE: padded columns are zero codes and scales: they compute 0 and are dropped

        def by_panel(t: torch.Tensor, per_row: int) -> torch.Tensor:  # [rows, blocks * per_row] -> [P, B, per_row, 16]
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
            return t.view(panels, PANEL, blocks, per_row).permute(0, 2, 3, 1)

        def as_bytes(t: torch.Tensor) -> torch.Tensor:  # [P, B, n, 16] -> [P, B, n * 16 * itemsize] uint8
            return t.contiguous().view(torch.uint8).reshape(panels, blocks, -1)

        # NOTE: torch's CPU allocator aligns to 64 bytes, as the kernel's aligned AVX-512 loads need: each result
        # below is a fresh tensor.
        if self.group == BLOCK // 2:  # two halves of 16 k: d[16], m[16], then codes [16 k][16 columns]
            offsets = torch.zeros_like(self.scales) if self.offsets is None else self.offsets
            d = by_panel(self.scales, 2).contiguous().view(torch.uint8)  # [P, B, 2, 64]
            m = by_panel(offsets, 2).contiguous().view(torch.uint8)
            q = by_panel(self.q, BLOCK).contiguous().view(torch.uint8).reshape(panels, blocks, 2, -1)  # [P, B, 2, 256]
            return torch.cat([d, m, q], dim=-1)
        assert self.offsets is not None
        scales = torch.cat([by_panel(self.scales, 1), by_panel(self.offsets, 1)], dim=2)  # [P, B, 2, 16]: d, m
        q = by_panel(self.q, BLOCK)  # [P, B, 32, 16]
        if self.bits == 4:  # low nibble k, high nibble k + 1
            pairs = q.view(torch.uint8).reshape(panels, blocks, BLOCK // 2, 2, PANEL)
            q = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)
        return torch.cat([as_bytes(scales), as_bytes(q)], dim=-1)


def cat_rows(parts: Sequence[BlockCodes]) -> BlockCodes:
    """The codes of the shards of a fused projection stacked by rows, in the narrowest layout every shard fits:
    4-bit codes widen to 8 bits, a 32-k group to two 16-k groups with the same scale and offset (exact: each weight
    keeps its d, q and m)."""
    if len(parts) == 1:
        return parts[0]
    group, bits = min(p.group for p in parts), max(p.bits for p in parts)
    with_offsets = any(p.offsets is not None for p in parts)

    def widened(p: BlockCodes) -> tuple[torch.Tensor, torch.Tensor | None]:
        repeat = p.group // group
        offsets = p.offsets if p.offsets is not None or not with_offsets else torch.zeros_like(p.scales)
        scales = p.scales.repeat_interleave(repeat, dim=1) if repeat > 1 else p.scales
        if offsets is not None and repeat > 1:
            offsets = offsets.repeat_interleave(repeat, dim=1)
        return scales, offsets

    pairs = [widened(p) for p in parts]
    offsets = torch.cat([o for _, o in pairs if o is not None]) if with_offsets else None
    return BlockCodes(torch.cat([s for s, _ in pairs]), offsets, torch.cat([p.q for p in parts]), group, bits)
