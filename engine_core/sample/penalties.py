"""Repetition (prompt + output tokens, HF semantics) and frequency/presence (output tokens, OpenAI) penalties."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor
from engine_core.sampling_params import SamplingParams

# NOTE: the repetition penalty is applied clamped to this range (any value > 0 is accepted, as in vLLM): 1e-40 would
# divide a logit to +inf and 1e38 multiply one to -inf, which leaves NaN or nothing to sample. At 1e4 a seen token is
# already ~e^-1e4 less likely, so the clamp changes no meaningful output.
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
# NOTE: and penalised logits are capped: divided by the smallest temperature (GREEDY_EPS = 1e-5), 1e30 stays finite in
# float32 (max ~3.4e38), even when the model's own logits are huge.
PENALISED_LOGIT_MAX = 1e30


def applied_repetition_penalty(value: float) -> float:
    low, high = REPETITION_PENALTY_RANGE
    return min(max(value, low), high)


@dataclass
class PenaltyState:
    repetition: torch.Tensor  # [rows] float32, 1.0 = off
    frequency: torch.Tensor  # [rows] float32, 0.0 = off
    presence: torch.Tensor  # [rows] float32, 0.0 = off
    rows: torch.Tensor  # [rows] int64: each row's row in the count/mask tensors (0 = scratch row)
    output_counts: torch.Tensor  # [penalty rows, vocab] int32, persistent, updated by `record`
    prompt_mask: torch.Tensor  # [penalty rows, vocab] bool, persistent
    any_repetition: bool
    any_frequency: bool
    any_presence: bool


def apply_penalties(logits: torch.Tensor, state: PenaltyState) -> torch.Tensor:
    # NOTE: row gathers use indexing, not index_select, which is ~10x slower on CPU for int32 rows this wide.
    counts = state.output_counts[state.rows]  # [rows, vocab] int32
    if state.any_repetition:
        seen = state.prompt_mask[state.rows] | (counts > 0)
        rep = state.repetition.unsqueeze(1)
        # HF semantics: a seen token's logit moves toward "less likely" whatever its sign.
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits.clamp_(max=PENALISED_LOGIT_MAX)
    if state.any_frequency:
        logits = logits - state.frequency.unsqueeze(1) * counts
    if state.any_presence:
        logits = logits - state.presence.unsqueeze(1) * (counts > 0)
    return logits


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class BoundPenalties(BoundProcessor):
    def __init__(self, state: PenaltyState) -> None:
        self.state = state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.state)

    def record(self, tokens: torch.Tensor, host_tokens: np.ndarray | None) -> None:
        # NOTE: unpenalised rows count into the scratch row 0, which keeps this one branch-free scatter.
        ones = torch.ones(len(tokens), dtype=torch.int32, device=tokens.device)
        self.state.output_counts.index_put_((self.state.rows, tokens), ones, accumulate=True)


class PenaltiesProcessor(LogitsProcessor):
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        super().__init__(vocab_size, device, max_rows)
        # NOTE: penalty state has its own rows, allocated only for sequences that use penalties and grown on demand,
        # so a [max_rows, vocab] count tensor is not paid for by batches that never penalise. Row 0 is a scratch row.
        self._output_counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
        self._prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self._free_rows: list[int] = []
        self._rows: dict[int, tuple[int, SamplingParams]] = {}  # slot -> (penalty row, params)

    def update_state(self, update: BatchUpdate) -> None:
        for slot in update.removed:
            entry = self._rows.pop(slot, None)
            if entry is not None:
                self._free_rows.append(entry[0])
        for row in update.added:
            if has_penalties(row.params):
                penalty_row = self._alloc_row(row.prompt_token_ids, row.output_token_ids)
                self._rows[row.slot] = (penalty_row, row.params)

    def _alloc_row(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        if not self._free_rows:
            old = self._output_counts.shape[0]
            new = max(2, 2 * old)  # row 0 is scratch; doubling keeps reallocations logarithmic
            extra = (new - old, self.vocab_size)
            self._output_counts = torch.cat([self._output_counts, self._output_counts.new_zeros(extra)])
            self._prompt_mask = torch.cat([self._prompt_mask, self._prompt_mask.new_zeros(extra)])
            self._free_rows = list(range(new - 1, old - 1, -1))
            self.generation += 1
        row = self._free_rows.pop()
        self._prompt_mask[row].zero_()
        self._prompt_mask[row, torch.as_tensor(list(prompt_token_ids), dtype=torch.int64, device=self.device)] = True
        out = torch.as_tensor(list(output_token_ids), dtype=torch.int64, device=self.device)
        self._output_counts[row] = torch.bincount(out, minlength=self.vocab_size).to(torch.int32)
        return row

    def bind(self, slots: Sequence[int]) -> BoundPenalties | None:
        if not self._rows:
            return None
        entries = [self._rows.get(slot) for slot in slots]
        if all(e is None for e in entries):
            return None
        neutral = SamplingParams()
        params = [neutral if e is None else e[1] for e in entries]
        dev = self.device
        return BoundPenalties(
            PenaltyState(
                repetition=torch.tensor(
                    [applied_repetition_penalty(p.repetition_penalty) for p in params], dtype=torch.float32, device=dev
                ),
                frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev),
                presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
                rows=torch.tensor([0 if e is None else e[0] for e in entries], dtype=torch.int64, device=dev),
                output_counts=self._output_counts,
                prompt_mask=self._prompt_mask,
                any_repetition=any(p.repetition_penalty != 1.0 for p in params),
                any_frequency=any(p.frequency_penalty != 0.0 for p in params),
                any_presence=any(p.presence_penalty != 0.0 for p in params),
            )
        )

    def is_argmax_invariant(self) -> bool:
        return False
