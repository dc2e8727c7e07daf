"""A tied embedding read from its LM head's block codes: each token's row decoded from `coded_linear`'s records.

NOTE: a GGUF model with tied embeddings (the default SmolLM2: Q8_0 `token_embd`) holds its table twice otherwise:
the LM head keeps the table as codes (35 MB) and the embedding as float32 (113 MB). A step gathers one row per
token, so decoding the rows it needs costs nothing measurable beside the step's GEMMs, and the rows are the table's
bits: every layout decodes w = d * q + m with d * q exact (a scale of at most 19 significant bits times a code of at
most 8) except Q6_K's, whose m is 0, so d * q rounds once either way.
"""

from __future__ import annotations

import torch
from torch import nn

PANEL = 16  # rows of the table per record (coded_linear.cpp's kCols)
BLOCK = 32  # columns of the table per record (kBlock)
SCALE_BYTES = 2 * PANEL * 4  # d[16] and m[16] float32 at the head of each record (or of each half)


class CodedEmbedding(nn.Module):
    """`embedding(ids)` for a `[num_embeddings, dim]` table held as `coded_linear` records (layers/block_codes.py)."""

    def __init__(self, records: torch.Tensor, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.records = records  # shared with the LM head's forms, not a copy
        self.num_embeddings, self.dim = num_embeddings, dim
        self.blocks = dim // BLOCK
        self.halves = records.dim() == 4  # [P, B, 2, 384]: 16-k groups, int8 codes
        self.four_bit = not self.halves and records.shape[2] == SCALE_BYTES + BLOCK * PANEL // 2
        self.record_bytes = records[0, 0].numel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = ids.shape
        flat = self.records.view(-1)
        scales = flat.view(torch.float32)
        ids = ids.reshape(-1).long()
        j = (ids % PANEL).view(-1, 1, 1)
        # byte offset of each (token, block) record: [T, B, 1]
        base = ((ids // PANEL).view(-1, 1) * self.blocks + torch.arange(self.blocks)).unsqueeze(-1) * self.record_bytes
        if self.halves:
            half = torch.arange(2).view(1, 1, 2, 1) * (self.record_bytes // 2)
            at = base.unsqueeze(-1) + half  # [T, B, 2, 1]
            j4 = j.unsqueeze(-1)
            d = scales[(at + 4 * j4) // 4]
            m = scales[(at + SCALE_BYTES // 2 + 4 * j4) // 4]
            codes = flat[at + SCALE_BYTES + torch.arange(BLOCK // 2) * PANEL + j4].view(torch.int8)  # [T, B, 2, 16]
        else:
            d = scales[(base + 4 * j) // 4]
            m = scales[(base + SCALE_BYTES // 2 + 4 * j) // 4]
            k = torch.arange(BLOCK)
            if self.four_bit:  # low nibble k, high nibble k + 1
                byte = flat[base + SCALE_BYTES + (k // 2) * PANEL + j]
                codes = (byte >> ((k % 2) * 4).to(torch.uint8)) & 0x0F
            else:
                codes = flat[base + SCALE_BYTES + k * PANEL + j].view(torch.int8)
        return torch.addcmul(m, d, codes.float()).view(*shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, codes={tuple(self.records.shape)}"
