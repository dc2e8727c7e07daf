"""SamplingBatch: the sampler's half of the worker's persistent batch, and the per-step `SamplingMetadata`.

Each live sequence owns a slot. Its parameters are read into Python once (`add`), and `metadata(seq_ids)` turns
the slots of the sequences sampled this step into per-row tensors. That metadata is cached while the same
sequences sample in the same order, so a steady decode step builds nothing; the only state that changes per
step (output lengths for min_tokens, output-token counts for penalties) lives in persistent device tensors that
`append_tokens` updates with scatter ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_core.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for step `step` of a sequence seeded with `seed` (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass
class SeededRow:
    """The RNG of a seeded sequence.

    NOTE: the generator is reseeded from (seed, step) before every draw rather than left to advance. The noise of
    a step then depends on nothing but the seed and the sequence's own step count: not on batch mates, and not on
    preemption either (a resumed sequence restarts at step = number of outputs it already has).
    """

    seed: int
    step: int
    generator: torch.Generator

    def next_generator(self) -> torch.Generator:
        self.generator.manual_seed(step_seed(self.seed, self.step))
        self.step += 1
        return self.generator


@dataclass
class PenaltyState:
    """Repetition (prompt + output tokens, HF) and frequency/presence (output tokens, OpenAI) penalties."""

    repetition: torch.Tensor  # [rows] float32, 1.0 = off
    frequency: torch.Tensor  # [rows] float32, 0.0 = off
    presence: torch.Tensor  # [rows] float32, 0.0 = off
    rows: torch.Tensor  # [rows] int64: each row's row in the batch's count/mask tensors (0 = scratch row)
    output_counts: torch.Tensor  # [capacity + 1, vocab] int32, persistent, updated by `append_tokens`
    prompt_mask: torch.Tensor  # [capacity + 1, vocab] bool, persistent
    any_repetition: bool
    any_frequency: bool
    any_presence: bool


@dataclass
class MinTokensState:
    """Stop tokens to mask while a row's output is shorter than its min_tokens, as (row, token) pairs."""

    min_tokens: torch.Tensor  # [rows] int64
    output_lens: torch.Tensor  # [max_rows] int64, persistent, indexed by slot
    pair_rows: torch.Tensor  # [pairs] int64 row index
    pair_token_ids: torch.Tensor  # [pairs] int64


@dataclass
class LogitBias:
    """Sparse additive biases as (row, token, value) triples."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    values: torch.Tensor  # [entries] float32


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per sampled sequence (row order of the logits).

    A stage's field is None when no row needs that stage, so the sampler skips it entirely.
    """

    num_rows: int
    slots: torch.Tensor  # [rows] int64 slot of each row in the persistent batch
    all_greedy: bool
    all_random: bool
    is_greedy: torch.Tensor | None  # [rows] bool; None when all rows are greedy or all random
    temperature: torch.Tensor | None  # [rows] float32 (1.0 on greedy rows); None when all greedy
    top_p: torch.Tensor | None  # [rows] float32; None when no random row uses top-p
    top_k: torch.Tensor | None  # [rows] int64 in [1, vocab], 0 = off; None when no random row uses top-k
    max_top_k: int  # the largest enabled top_k (host-side, so no device sync is needed to size topk)
    min_p: torch.Tensor | None  # [rows] float32; None when no random row uses min-p
    penalties: PenaltyState | None
    min_tokens: MinTokensState | None
    logit_bias: LogitBias | None
    generators: dict[int, SeededRow]  # row -> RNG of the seeded random rows
    shared_generator: torch.Generator  # for the unseeded random rows
    max_num_logprobs: int | None  # k = the largest `logprobs` asked by a row; None when no row asked


@dataclass
class _SlotInfo:
    seq_id: int
    params: SamplingParams
    greedy: bool
    seeded: SeededRow | None  # None for unseeded or greedy sequences
    penalty_row: int  # row in the count/mask tensors, 0 when the sequence has no penalties


def _is_greedy(params: SamplingParams) -> bool:
    # NOTE: top_k == 1 is sampled as greedy so that it equals argmax exactly, ties included.
    return params.greedy or params.top_k == 1


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


class SamplingBatch:
    def __init__(self, vocab_size: int, device: torch.device | str, max_rows: int, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._slots: dict[int, int] = {}  # seq_id -> slot
        self._info: list[_SlotInfo | None] = [None] * max_rows
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self._output_lens = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.shared_generator = torch.Generator(device=self.device)
        if seed is None:
            self.shared_generator.seed()
        else:
            self.shared_generator.manual_seed(seed)
        # NOTE: penalty state has its own rows, allocated only for sequences that use penalties and grown on
        # demand, so a [max_rows, vocab] count tensor is not paid for by batches that never penalise. Row 0 is a
        # scratch row: unpenalised sequences scatter their counts there, which keeps `append_tokens` branch-free.
        self._penalty_rows = torch.zeros(max_rows, dtype=torch.int64, device=self.device)  # slot -> penalty row
        self._output_counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=self.device)
        self._prompt_mask = torch.zeros(1, vocab_size, dtype=torch.bool, device=self.device)
        self._free_penalty_rows: list[int] = []
        self._cached_ids: list[int] | None = None
        self._cached_id_set: set[int] = set()
        self._cached: SamplingMetadata | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._slots

    # ---- membership ---------------------------------------------------------------------------------------------
    def add(
        self,
        seq_id: int,
        params: SamplingParams,
        seed: int | None,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
    ) -> None:
        """Adds a sequence (new, or resumed after preemption with its outputs so far)."""
        if seq_id in self._slots:
            raise ValueError(f"sequence {seq_id} is already in the sampling batch")
        if not self._free_slots:
            raise RuntimeError(f"sampling batch is full ({self.max_rows} sequences)")
        params.validate_vocab(self.vocab_size)
        slot = self._free_slots.pop()
        greedy = _is_greedy(params)
        seeded = None
        if seed is not None and not greedy:
            seeded = SeededRow(seed, len(output_token_ids), torch.Generator(device=self.device))
        penalty_row = self._alloc_penalty_row(prompt_token_ids, output_token_ids) if _has_penalties(params) else 0
        self._penalty_rows[slot] = penalty_row
        self._output_lens[slot] = len(output_token_ids)
        self._slots[seq_id] = slot
        self._info[slot] = _SlotInfo(seq_id, params, greedy, seeded, penalty_row)

    def remove(self, seq_id: int) -> None:
        """Forgets a sequence; unknown ids are ignored (a sequence may finish before it ever sampled)."""
        slot = self._slots.pop(seq_id, None)
        if slot is None:
            return
        info = self._info[slot]
        assert info is not None
        if info.penalty_row:
            self._free_penalty_rows.append(info.penalty_row)
        self._info[slot] = None
        self._free_slots.append(slot)
        if seq_id in self._cached_id_set:
            self._invalidate()

    def _invalidate(self) -> None:
        self._cached_ids, self._cached_id_set, self._cached = None, set(), None

    def _alloc_penalty_row(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> int:
        if not self._free_penalty_rows:
            old = self._output_counts.shape[0]
            new = max(2, 2 * old)  # row 0 is scratch; doubling keeps reallocations logarithmic
            grow = new - old
            extra = (grow, self.vocab_size)
            self._output_counts = torch.cat([self._output_counts, self._output_counts.new_zeros(extra)])
            self._prompt_mask = torch.cat([self._prompt_mask, self._prompt_mask.new_zeros(extra)])
            self._free_penalty_rows = list(range(new - 1, old - 1, -1))
            self._invalidate()  # cached metadata points at the old tensors
        row = self._free_penalty_rows.pop()
        self._prompt_mask[row].zero_()
        self._prompt_mask[row, torch.as_tensor(list(prompt_token_ids), dtype=torch.int64, device=self.device)] = True
        out = torch.as_tensor(list(output_token_ids), dtype=torch.int64, device=self.device)
        self._output_counts[row] = torch.bincount(out, minlength=self.vocab_size).to(torch.int32)
        return row

    # ---- per step -----------------------------------------------------------------------------------------------
    def metadata(self, seq_ids: Sequence[int]) -> SamplingMetadata:
        """The metadata for the sequences sampled this step, in row order; reused while that list is unchanged."""
        ids = seq_ids if isinstance(seq_ids, list) else list(seq_ids)
        if self._cached is not None and self._cached_ids == ids:
            return self._cached
        meta = self._build(ids)
        self._cached_ids = list(ids)
        self._cached_id_set = set(ids)
        self._cached = meta
        return meta

    def append_tokens(self, seq_ids: Sequence[int], token_ids: torch.Tensor) -> None:
        """Records the tokens sampled for `seq_ids` (row order) in the state penalties and min_tokens read."""
        meta = self.metadata(seq_ids)
        token_ids = token_ids.to(device=self.device, dtype=torch.int64)
        # NOTE: only rows that read this state need it updated; a sequence's state is touched only by the steps
        # it samples in, so it stays exact for the sequences that use it and is skipped for the rest.
        if meta.min_tokens is not None:
            self._output_lens.index_add_(0, meta.slots, torch.ones_like(meta.slots))
        if meta.penalties is not None:
            ones = torch.ones(len(seq_ids), dtype=torch.int32, device=self.device)
            self._output_counts.index_put_((meta.penalties.rows, token_ids), ones, accumulate=True)

    def _build(self, seq_ids: Sequence[int]) -> SamplingMetadata:
        infos: list[_SlotInfo] = []
        for seq_id in seq_ids:
            if seq_id not in self._slots:
                raise KeyError(f"sequence {seq_id} is not in the sampling batch")
            info = self._info[self._slots[seq_id]]
            assert info is not None
            infos.append(info)
        dev = self.device
        params = [i.params for i in infos]
        greedy = [i.greedy for i in infos]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        n = len(infos)

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=dev)

        all_greedy = all(greedy)
        all_random = not any(greedy)
        temperature = None
        if not all_greedy:
            temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
        top_p = top_k = min_p = None
        enabled_k = [min(p.top_k, self.vocab_size) for p in random_params if p.top_k > 0]
        if enabled_k:
            top_k = i64([0 if g else min(p.top_k, self.vocab_size) for p, g in zip(params, greedy, strict=True)])
        if any(p.top_p < 1.0 for p in random_params):
            top_p = f32([1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)])
        if any(p.min_p > 0.0 for p in random_params):
            min_p = f32([0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)])
        logprob_ks = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            num_rows=n,
            slots=i64([self._slots[s] for s in seq_ids]),
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else torch.tensor(greedy, dtype=torch.bool, device=dev),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_top_k=max(enabled_k, default=0),
            min_p=min_p,
            penalties=self._build_penalties(infos),
            min_tokens=self._build_min_tokens(infos),
            logit_bias=self._build_logit_bias(params),
            generators={row: i.seeded for row, i in enumerate(infos) if i.seeded is not None},
            shared_generator=self.shared_generator,
            max_num_logprobs=max(logprob_ks) if logprob_ks else None,
        )

    def _build_penalties(self, infos: list[_SlotInfo]) -> PenaltyState | None:
        if not any(i.penalty_row for i in infos):
            return None
        params = [i.params for i in infos]
        dev = self.device
        return PenaltyState(
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=dev),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=dev),
            rows=torch.tensor([i.penalty_row for i in infos], dtype=torch.int64, device=dev),
            output_counts=self._output_counts,
            prompt_mask=self._prompt_mask,
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_frequency=any(p.frequency_penalty != 0.0 for p in params),
            any_presence=any(p.presence_penalty != 0.0 for p in params),
        )

    def _build_min_tokens(self, infos: list[_SlotInfo]) -> MinTokensState | None:
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        for row, info in enumerate(infos):
            if info.params.min_tokens > 0:
                stop_ids = sorted(info.params.all_stop_token_ids)
                pair_rows += [row] * len(stop_ids)
                pair_ids += stop_ids
        if not pair_rows:
            return None
        dev = self.device
        return MinTokensState(
            min_tokens=torch.tensor([i.params.min_tokens for i in infos], dtype=torch.int64, device=dev),
            output_lens=self._output_lens,
            pair_rows=torch.tensor(pair_rows, dtype=torch.int64, device=dev),
            pair_token_ids=torch.tensor(pair_ids, dtype=torch.int64, device=dev),
        )

    def _build_logit_bias(self, params: list[SamplingParams]) -> LogitBias | None:
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for row, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                rows.append(row)
                ids.append(tok)
                values.append(float(bias))
        if not rows:
            return None
        dev = self.device
        return LogitBias(
            rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            token_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            values=torch.tensor(values, dtype=torch.float32, device=dev),
        )
