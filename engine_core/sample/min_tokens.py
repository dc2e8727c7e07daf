"""min_tokens: a row's stop tokens (EOS included unless ignore_eos) are masked while its output is shorter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor


@dataclass
class MinTokensState:
    """Stop tokens to mask while a row's output is shorter than its min_tokens, as (row, token) pairs."""

    slots: torch.Tensor  # [rows] int64 slot of each row
    min_tokens: torch.Tensor  # [rows] int64
    output_lens: torch.Tensor  # [max_rows] int64, persistent, indexed by slot
    pair_rows: torch.Tensor  # [pairs] int64 row index
    pair_token_ids: torch.Tensor  # [pairs] int64


class BoundMinTokens(BoundProcessor):
    def __init__(self, state: MinTokensState) -> None:
        self.state = state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        state = self.state
        active = state.output_lens[state.slots] < state.min_tokens  # [rows]
        current = logits[state.pair_rows, state.pair_token_ids]
        # NOTE: a where() over the pairs instead of boolean indexing: no device sync, the same kernels every step.
        masked = torch.where(active[state.pair_rows], torch.full_like(current, float("-inf")), current)
        logits[state.pair_rows, state.pair_token_ids] = masked
        return logits

    def record(self, tokens: torch.Tensor, host_tokens: np.ndarray | None) -> None:
        # NOTE: a row's length is counted only in the steps it samples in, all of which bind this processor.
        self.state.output_lens.index_add_(0, self.state.slots, torch.ones_like(self.state.slots))


class MinTokensProcessor(LogitsProcessor):
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        super().__init__(vocab_size, device, max_rows)
        self._rows: dict[int, tuple[int, list[int]]] = {}  # slot -> (min_tokens, sorted stop ids)
        self._output_lens = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def update_state(self, update: BatchUpdate) -> None:
        for slot in update.removed:
            self._rows.pop(slot, None)
        for row in update.added:
            stop_ids = sorted(row.params.all_stop_token_ids)
            if row.params.min_tokens > 0 and stop_ids:
                self._rows[row.slot] = (row.params.min_tokens, stop_ids)
                self._output_lens[row.slot] = len(row.output_token_ids)

    def bind(self, slots: Sequence[int]) -> BoundMinTokens | None:
        if not self._rows:
            return None
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        min_tokens: list[int] = []
        for row, slot in enumerate(slots):
            count, stop_ids = self._rows.get(slot, (0, []))
            min_tokens.append(count)
            pair_rows += [row] * len(stop_ids)
            pair_ids += stop_ids
        if not pair_rows:
            return None
        dev = self.device
        return BoundMinTokens(
            MinTokensState(
                slots=torch.tensor(list(slots), dtype=torch.int64, device=dev),
                min_tokens=torch.tensor(min_tokens, dtype=torch.int64, device=dev),
                output_lens=self._output_lens,
                pair_rows=torch.tensor(pair_rows, dtype=torch.int64, device=dev),
                pair_token_ids=torch.tensor(pair_ids, dtype=torch.int64, device=dev),
            )
        )

    def is_argmax_invariant(self) -> bool:
        return False
