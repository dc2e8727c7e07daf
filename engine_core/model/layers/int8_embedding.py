"""A tied embedding read from its LM head's int8 form (`quantization="int8"`): row r is `codes[r] * scale[r]`.

NOTE: an int8 model with tied embeddings (the default SmolLM2) held its table twice otherwise: the LM head's int8
codes (28 MB, per-row scales) and the float32 embedding (113 MB) that the layer loop and the native decode step's
gather read. A step gathers one row per token, so widening the rows it needs costs nothing beside the step's GEMMs.
Each value is one float32 product of an exact code and the row's scale, so this module and the native gather
(kernels/cpu/decode_int8.cpp, `decode_int8_head`) give the same bits. An untied embedding is not a linear weight and
stays float32 (docs/decisions.md, "CPU kernels": int8 embeddings).
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Embedding(nn.Module):
    """`embedding(ids)` for a `[num_embeddings, dim]` table held as int8 `codes` with float32 per-row `scale`."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != codes.shape[:1]:
            raise ValueError(f"int8 codes [rows, dim] and float32 scales [rows]; got {codes.shape}, {scale.shape}")
        self.codes, self.scale = codes, scale  # the LM head's own tensors, not copies
        self.num_embeddings, self.dim = codes.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        # NOTE: widened, then scaled in place: torch.mul's int8 x float32 promotion gives the same bits but ran 7x
        # slower at 512 rows (benchmarks/int8_embedding.py's shapes)
        rows = self.codes.index_select(0, flat).float()
        return rows.mul_(self.scale.index_select(0, flat).unsqueeze(1)).view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, int8"
