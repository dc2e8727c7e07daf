"""GGUF's legacy block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; 32 weights a block) unpacked into `BlockCodes`, in
torch, for the linears that keep codes on CUDA (layers/cuda_codes.py).

The layouts are gguf-py's (`gguf.quants.Q4_0` ...): an f16 d (and for _1 an f16 m), then the codes; Q4: 16 bytes
of nibbles (low nibbles the block's first 16 weights, high its last 16); Q5: a 32-bit word of fifth bits (bit i:
weight i) before Q4's nibbles; Q8_0: 32 int8 codes. The zero points become offsets: Q4_0's w = d * (q - 8) is
fma(d, q, -8d), exact (d * q and the sum fit float32's mantissa: an 11-bit d times a code of at most 5 bits), so
`values()` gives gguf-py's (and transformers') float32 weights bit for bit (tests/test_gguf_legacy_codes.py).

NOTE: the CPU linears find these codes from the float32 weight themselves (`coded_pack`), so the CPU load does not
ask for them.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from engine_core.model.layers.block_codes import BlockCodes

Q = GGMLQuantizationType
GROUP = 32
LEGACY = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24}  # bytes per block of 32


def unpack_legacy(kind: GGMLQuantizationType, raw: torch.Tensor, shape: tuple[int, ...]) -> BlockCodes:
    """A `[rows, K]` tensor's codes from its bytes `raw` (uint8, K a multiple of 32)."""
    rows, k = shape[0], shape[1]
    blocks = raw.view(-1, LEGACY[kind])
    d = _f16(blocks[:, 0:2])
    if kind == Q.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8)
        return BlockCodes(d.reshape(rows, -1), None, q.reshape(rows, k), group=GROUP, bits=8)
    has_m = kind in (Q.Q4_1, Q.Q5_1)
    head = 4 if has_m else 2
    five = kind in (Q.Q5_0, Q.Q5_1)
    nibbles = blocks[:, head + 4 * five :]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)  # [blocks, 32] uint8
    if five:
        bits = blocks[:, head : head + 4].contiguous().view(torch.int32)  # [blocks, 1]
        fifth = (bits >> torch.arange(32, dtype=torch.int32)) & 1
        q = q | (fifth.to(torch.uint8) << 4)
    # Q4_0 / Q5_0: the zero point as an offset, exact (a power of two times d)
    offsets = _f16(blocks[:, 2:4]) if has_m else d * -(16.0 if five else 8.0)
    return BlockCodes(
        d.reshape(rows, -1),
        offsets.reshape(rows, -1),
        q.view(torch.int8).reshape(rows, k),
        group=GROUP,
        bits=8 if five else 4,
    )


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """`[B, 2]` uint8 -> `[B, 1]` float32 (little-endian f16, widened exactly)."""
    return two_bytes.contiguous().view(torch.float16).float()
