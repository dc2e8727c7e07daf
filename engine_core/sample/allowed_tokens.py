"""allowed_token_ids: a row may sample only from its list (vLLM's field); every other token is masked."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor


class BoundAllowedTokens(BoundProcessor):
    def __init__(self, rows: torch.Tensor, banned: torch.Tensor) -> None:
        self.rows = rows  # [active] int64 rows with a list
        self.banned = banned  # [active, vocab] bool: True = not in the row's list

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows] = logits[self.rows].masked_fill_(self.banned, float("-inf"))
        return logits


class AllowedTokensProcessor(LogitsProcessor):
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        super().__init__(vocab_size, device, max_rows)
        self._banned: dict[int, torch.Tensor] = {}  # slot -> [vocab] bool, built once when the sequence arrives

    def update_state(self, update: BatchUpdate) -> None:
        for slot in update.removed:
            self._banned.pop(slot, None)
        for row in update.added:
            allowed = row.params.allowed_token_ids
            if allowed:
                banned = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
                banned[torch.tensor(allowed, dtype=torch.int64, device=self.device)] = False
                self._banned[row.slot] = banned

    def bind(self, slots: Sequence[int]) -> BoundAllowedTokens | None:
        if not self._banned:
            return None
        rows = [row for row, slot in enumerate(slots) if slot in self._banned]
        if not rows:
            return None
        banned = torch.stack([self._banned[slots[row]] for row in rows])
        return BoundAllowedTokens(torch.tensor(rows, dtype=torch.int64, device=self.device), banned)

    def is_argmax_invariant(self) -> bool:
        return False
