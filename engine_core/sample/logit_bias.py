"""logit_bias: sparse additive biases per row (OpenAI's [-100, 100] per token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor


@dataclass
class LogitBias:
    """Sparse additive biases as (row, token, value) triples."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    values: torch.Tensor  # [entries] float32


class BoundLogitBias(BoundProcessor):
    def __init__(self, bias: LogitBias) -> None:
        self.bias = bias

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
        return logits


class LogitBiasProcessor(LogitsProcessor):
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        super().__init__(vocab_size, device, max_rows)
        self._bias: dict[int, dict[int, float]] = {}  # slot -> token -> bias

    def update_state(self, update: BatchUpdate) -> None:
        for slot in update.removed:
            self._bias.pop(slot, None)
        for row in update.added:
            if row.params.logit_bias:
                self._bias[row.slot] = dict(row.params.logit_bias)

    def bind(self, slots: Sequence[int]) -> BoundLogitBias | None:
        if not self._bias:
            return None
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row, slot in enumerate(slots):
            for tok, value in self._bias.get(slot, {}).items():
                rows.append(row)
                ids.append(tok)
                values.append(float(value))
        if not rows:
            return None
        dev = self.device
        return BoundLogitBias(
            LogitBias(
                rows=torch.tensor(rows, dtype=torch.int64, device=dev),
                token_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
                values=torch.tensor(values, dtype=torch.float32, device=dev),
            )
        )

    def is_argmax_invariant(self) -> bool:
        return False
