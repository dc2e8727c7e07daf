"""GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K; 256 weights each) unpacked into `BlockCodes`, in torch.

The layouts and the decoding are gguf-py's (`gguf.quants.Q4_K` ...), which is what transformers' GGUF loader runs:
- Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
  nibbles (per 64 weights: 32 bytes, low nibbles the first sub-block, high the second); w = d*sc*q - dmin*m;
- Q5_K (176 bytes): Q4_K's head, 32 bytes of fifth bits (bit i of byte j: weight j of sub-block i), 128 bytes of
  nibbles;
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2 high bits, 16 int8 scales (one per 16 weights), f16 d;
  w = d*sc*(q - 32).
tests/test_kquant_codes.py holds `values()` equal to gguf-py's `dequantize` bit for bit on random blocks.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from engine_core.model.layers.block_codes import BlockCodes

Q = GGMLQuantizationType
SUPER = 256  # weights per super-block
KQUANTS = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # bytes per super-block


def unpack_kquant(kind: GGMLQuantizationType, raw: torch.Tensor, shape: tuple[int, ...]) -> BlockCodes:
    """A `[rows, K]` tensor's codes from its bytes `raw` (uint8, K a multiple of 256)."""
    rows, k = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
    blocks = raw.view(-1, KQUANTS[kind])
    n = blocks.shape[0]
    if kind == Q.Q6_K:
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        q = ((ql & 0x0F).reshape(n, 8, 32) | ((qh & 0x03).reshape(n, 8, 32) << 4)).view(torch.int8) - 32
        scales = _f16(blocks[:, 208:210]) * blocks[:, 192:208].contiguous().view(torch.int8).float()
        return BlockCodes(scales.reshape(rows, -1), None, q.reshape(rows, k), group=16, bits=8)
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mins = _scales_and_mins(blocks[:, 4:16])
    ql = blocks[:, -128:].reshape(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    q = (ql & 0x0F).reshape(n, 8, 32)
    if kind == Q.Q5_K:
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        q = q | ((qh & 0x01) << 4)
    # NOTE: -(dmin * m) is gguf-py's `- dm` as an addend: the negation is exact, so fma(d, q, -dm) rounds as it does.
    return BlockCodes(
        (d * sc).reshape(rows, -1),
        (-(dmin * mins)).reshape(rows, -1),
        q.view(torch.int8).reshape(rows, k),
        group=32,
        bits=4 if kind == Q.Q4_K else 8,
    )


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 6-bit scales and 8 6-bit mins per super-block (gguf-py's `Q4_K.get_scale_min`), as float32."""
    s = packed.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mins.float()


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """`[B, 2]` uint8 -> `[B, 1]` float32 (little-endian f16, widened exactly)."""
    return two_bytes.contiguous().view(torch.float16).float()
