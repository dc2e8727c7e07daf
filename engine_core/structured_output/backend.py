"""The grammar-engine interface (after vLLM V1's structured_output backends): compile a constraint into a matcher,
advance matchers by sampled tokens, fill token bitmasks.

A bitmask row holds one bit per vocabulary entry in int32 words (bit `t % 32` of word `t // 32`; 1 = allowed), the
layout llguidance and xgrammar share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from engine_core.structured_output.params import StructuredOutputsParams

# Compiled grammars a backend keeps (and the scheduler's gate remembers as compiled: core/grammar_gate.py).
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputError(Exception):
    """A request's constraint cannot go on (it failed to compile, or its grammar allows no token)."""


@dataclass(frozen=True)
class GrammarCompile:
    """One matcher made for a sequence (for metrics and the step's span): compiled, or copied from the cache."""

    kind: str  # ConstraintKind value
    seconds: float
    cache_hit: bool
    start: float  # time.perf_counter()


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def consume(self, token_id: int) -> bool:
        """Advances by a sampled token; False when the grammar does not allow it (the matcher is then in error)."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher cannot go on; None while it can."""


class StructuredOutputBackend(ABC):
    @abstractmethod
    def prepare(self, params: StructuredOutputsParams) -> Future[None]:
        """Compiles the constraint off the caller's thread into the cache (done at once on a hit); the future
        raises StructuredOutputError when it does not compile."""

    @abstractmethod
    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint (compiled grammars cached by `params.key`; one being
        prepared is waited for, one never prepared compiled here). Raises StructuredOutputError when the constraint
        does not compile."""

    @abstractmethod
    def fill_masks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Writes each matcher's allowed next tokens into `bitmask[row]` ([rows, words] int32). May be called from a
        thread other than the one that consumes tokens, never at the same time as it."""
