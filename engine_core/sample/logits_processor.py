"""The logits-processor seam: per-request logits transforms with their own per-row state (vLLM V1's LogitsProcessor).

A processor follows the sampling batch's membership (`update_state`: sequences added with their parameters and
tokens so far, sequences removed, by their stable slot) and, for one step's rows, returns a `BoundProcessor` whose
`apply(logits)` transforms the [rows, vocab] fp32 logits. `bind` returns None when none of the step's rows uses the
processor, so an unused processor costs nothing per step. The bound object is cached with the step's metadata while
the same sequences sample in the same order, so a steady decode step binds nothing.

NOTE: where vLLM condenses its persistent batch and tells processors which rows moved, the worker here keeps every
sequence in a fixed slot and each step samples a subset of slots in its own order (decode rows first): `bind(slots)`
receives that row -> slot order, which carries the same information as vLLM's move list.

Sampled tokens reach the processors through `BoundProcessor.record`, after the step (on the device and, for those that
match token sequences, on the host). A structured-output grammar plugs in here: a processor whose bound form applies
the step's token bitmask to its rows and whose `record` advances each row's matcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine_core.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddedRow:
    """A sequence joining the sampling batch: new, or resumed after preemption with its outputs so far."""

    slot: int
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass
class BatchUpdate:
    """Membership changes since the last update, applied in this order: removed, then added."""

    removed: list[int] = field(default_factory=list)  # slots
    added: list[AddedRow] = field(default_factory=list)


class BoundProcessor(ABC):
    """A processor bound to one step's rows (the row order of the logits)."""

    # Whether `record` reads the sampled tokens on the host (token-sequence matching); device-only state does not.
    needs_host_tokens: bool = False

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transforms fp32 logits [rows, vocab] (in place or not) and returns them."""

    def record(self, tokens: torch.Tensor, host_tokens: np.ndarray | None) -> None:  # noqa: B027 (optional hook)
        """The tokens the step sampled for these rows ([rows] int64 on the device; on the host when
        `needs_host_tokens`). A failed row's token is -1 on the host and 0 on the device."""


class LogitsProcessor(ABC):
    """One kind of logits transform over the whole sampling batch, with per-slot state."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max_rows
        # Bumped when bound forms made before no longer hold (the processor reallocated the state they point at).
        self.generation = 0

    @abstractmethod
    def update_state(self, update: BatchUpdate) -> None:
        """Follows membership: forget the removed slots, take the added rows this processor applies to."""

    @abstractmethod
    def bind(self, slots: Sequence[int]) -> BoundProcessor | None:
        """This step's form for rows in `slots` order; None when no row uses the processor."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when `apply` can never change a row's argmax: all-greedy steps then skip it."""
