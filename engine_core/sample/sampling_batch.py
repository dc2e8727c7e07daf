"""SamplingBatch: the sampler's half of the worker's persistent batch, and the per-step `SamplingMetadata`.

Each live sequence owns a slot. Its parameters are read into Python once (`add`), and `metadata(seq_ids)` turns
the slots of the sequences sampled this step into per-row tensors. That metadata is cached while the same
sequences sample in the same order, so a steady decode step builds nothing. Per-request logits transforms
(allowed_token_ids, bad_words, min_tokens, logit_bias, penalties) are logits processors (logits_processor.py) that
follow the batch's membership; the state that changes per step (output lengths, output-token counts) lives in
their persistent tensors, which `append_tokens` updates with scatter ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.sample.allowed_tokens import AllowedTokensProcessor
from engine_core.sample.bad_words import BadWordsProcessor
from engine_core.sample.logit_bias import LogitBiasProcessor
from engine_core.sample.logits_processor import AddedRow, BatchUpdate, BoundProcessor, LogitsProcessor
from engine_core.sample.min_tokens import MinTokensProcessor
from engine_core.sample.penalties import PenaltiesProcessor
from engine_core.sample.structured_output import StructuredOutputProcessor
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output.backend import StructuredOutputBackend

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
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per sampled sequence (row order of the logits).

    A stage's field is None (a processor is absent) when no row needs it, so the sampler skips it entirely.
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
    # The logits processors some row uses this step, in application order; `argmax_processors` are those of them
    # that can change an argmax (all an all-greedy step runs).
    processors: list[BoundProcessor]
    argmax_processors: list[BoundProcessor]
    generators: dict[int, SeededRow]  # row -> RNG of the seeded random rows
    shared_generator: torch.Generator  # for the unseeded random rows
    max_num_logprobs: int | None  # k = the largest `logprobs` asked by a row; None when no row asked


@dataclass
class _SlotInfo:
    seq_id: int
    params: SamplingParams
    greedy: bool
    seeded: SeededRow | None  # None for unseeded or greedy sequences


def _is_greedy(params: SamplingParams) -> bool:
    # NOTE: top_k == 1 is sampled as greedy so that it equals argmax exactly, ties included.
    return params.greedy or params.top_k == 1


# The built-in logits processors, in application order (vLLM V1's): masks first, then biases, then penalties.
PROCESSOR_TYPES: tuple[type[LogitsProcessor], ...] = (
    AllowedTokensProcessor,
    BadWordsProcessor,
    MinTokensProcessor,
    LogitBiasProcessor,
    PenaltiesProcessor,
)


class SamplingBatch:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        max_rows: int,
        seed: int | None = None,
        grammar_backend: StructuredOutputBackend | None = None,
    ) -> None:
        """`grammar_backend` compiles structured_outputs constraints; None: a constrained request fails alone."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._slots: dict[int, int] = {}  # seq_id -> slot
        self._info: list[_SlotInfo | None] = [None] * max_rows
        self._free_slots = list(range(max_rows - 1, -1, -1))
        self.shared_generator = torch.Generator(device=self.device)
        if seed is None:
            self.shared_generator.seed()
        else:
            self.shared_generator.manual_seed(seed)
        # NOTE: the grammar's mask goes first, as vLLM applies its bitmask before every other processor.
        self.structured_output = StructuredOutputProcessor(vocab_size, self.device, max_rows, grammar_backend)
        self.processors: list[LogitsProcessor] = [self.structured_output]
        self.processors += [cls(vocab_size, self.device, max_rows) for cls in PROCESSOR_TYPES]
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
        self._update_processors(BatchUpdate(added=[AddedRow(slot, params, prompt_token_ids, output_token_ids)]))
        self._slots[seq_id] = slot
        self._info[slot] = _SlotInfo(seq_id, params, greedy, seeded)

    def remove(self, seq_id: int) -> None:
        """Forgets a sequence; unknown ids are ignored (a sequence may finish before it ever sampled)."""
        slot = self._slots.pop(seq_id, None)
        if slot is None:
            return
        self._update_processors(BatchUpdate(removed=[slot]))
        self._info[slot] = None
        self._free_slots.append(slot)
        if seq_id in self._cached_id_set:
            self._invalidate()

    def _invalidate(self) -> None:
        self._cached_ids, self._cached_id_set, self._cached = None, set(), None

    def _update_processors(self, update: BatchUpdate) -> None:
        before = [p.generation for p in self.processors]
        for processor in self.processors:
            processor.update_state(update)
        if [p.generation for p in self.processors] != before:
            self._invalidate()  # cached metadata points at state a processor reallocated

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

    def append_tokens(
        self, seq_ids: Sequence[int], token_ids: torch.Tensor, host_token_ids: np.ndarray | None = None
    ) -> None:
        """Records the tokens sampled for `seq_ids` (row order) in the processors' state. A row that failed has
        token -1 (`host_token_ids`, when given, is `token_ids` read back to the host)."""
        meta = self.metadata(seq_ids)
        if not meta.processors:
            return
        token_ids = token_ids.to(device=self.device, dtype=torch.int64)
        if host_token_ids is None and any(p.needs_host_tokens for p in meta.processors):
            host_token_ids = token_ids.cpu().numpy()
        # NOTE: a failed row (-1) ends with this step; its device state only has to stay indexable.
        token_ids = token_ids.clamp_min(0)
        # NOTE: only rows that read this state need it updated; a sequence's state is touched only by the steps
        # it samples in, so it stays exact for the sequences that use it and is skipped for the rest.
        for processor in meta.processors:
            processor.record(token_ids, host_token_ids)

    def seed_of(self, seq_id: int) -> int | None:
        """A seeded random sequence's seed; None for the others (speculative decoding's draws follow it)."""
        slot = self._slots.get(seq_id)
        info = None if slot is None else self._info[slot]
        return None if info is None or info.seeded is None else info.seeded.seed

    def rewind_seeded(self, seq_id: int, steps: int) -> None:
        """Takes back a seeded sequence's last `steps` draws (speculative decoding: positions after a rejected draft
        were sampled but are not its outputs), so its step stays its number of outputs."""
        slot = self._slots.get(seq_id)
        info = None if slot is None else self._info[slot]
        if info is not None and info.seeded is not None:
            info.seeded.step -= steps

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
        logprob_ks += [p.num_beam_candidates for p in params if p.num_beam_candidates]
        slots = [self._slots[s] for s in seq_ids]
        bound = [(b, p) for p in self.processors if (b := p.bind(slots)) is not None]
        processors = [b for b, _ in bound]
        return SamplingMetadata(
            num_rows=n,
            slots=i64(slots),
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else torch.tensor(greedy, dtype=torch.bool, device=dev),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_top_k=max(enabled_k, default=0),
            min_p=min_p,
            processors=processors,
            argmax_processors=[b for b, p in bound if not p.is_argmax_invariant()],
            generators={row: i.seeded for row, i in enumerate(infos) if i.seeded is not None},
            shared_generator=self.shared_generator,
            max_num_logprobs=max(logprob_ks) if logprob_ks else None,
        )
