"""The structured-output logits processor: one grammar matcher per sequence (per slot), its token bitmask applied
to the row's logits, the matcher advanced by every sampled token.

NOTE: the matchers live in the worker, next to the sampler, because only the worker knows a step's tokens the moment
they are sampled: with async scheduling the scheduler plans step N+1 before step N's tokens reach it, so a mask made
there would be one step late. The mask for a sequence's next step is filled by a background thread right after
`record` advanced its matcher (llguidance computes it without the GIL), i.e. while the worker returns step N and
runs step N+1's forward; `apply` waits for it only when it is not done yet. A preempted or forked sequence comes back
through `update_state` with its outputs so far: its matcher is rebuilt by replaying them (the state is a pure
function of the tokens, so rebuild and rollback agree).

A failure is the request's alone: a constraint that does not compile, a matcher in error, or a mask that allows no
token makes `apply` raise StructuredOutputError, and the step's row-isolating sampler (worker/step_sampling.py)
fails that row with the message while its neighbours sample as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor
from engine_core.structured_output.backend import GrammarMatcher, StructuredOutputBackend, StructuredOutputError


class BoundStructuredOutput(BoundProcessor):
    needs_host_tokens = True

    def __init__(self, processor: StructuredOutputProcessor, rows: list[int], slots: list[int]) -> None:
        self.processor = processor
        self.rows = rows  # logits rows with a constraint
        self.slots = slots  # their slots
        self.rows_t = torch.tensor(rows, dtype=torch.int64, device=processor.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        masks = self.processor.masks(self.slots)  # raises before any logits change
        vocab = logits.shape[-1]
        if logits.device.type == "cpu":
            bits = np.unpackbits(masks.view(np.uint8), axis=1, count=vocab, bitorder="little")
            banned = torch.from_numpy(bits) == 0
        else:
            words = torch.from_numpy(masks).to(logits.device, non_blocking=True)
            shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
            banned = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(self.rows), -1)[:, :vocab] == 0
        logits[self.rows_t] = logits[self.rows_t].masked_fill_(banned, float("-inf"))
        return logits

    def record(self, tokens: torch.Tensor, host_tokens: np.ndarray | None) -> None:
        assert host_tokens is not None
        self.processor.advance(self.slots, [int(host_tokens[row]) for row in self.rows])


class StructuredOutputProcessor(LogitsProcessor):
    def __init__(
        self, vocab_size: int, device: torch.device, max_rows: int, backend: StructuredOutputBackend | None = None
    ) -> None:
        super().__init__(vocab_size, device, max_rows)
        self.backend = backend
        self._matchers: dict[int, GrammarMatcher] = {}  # slot -> matcher
        self._errors: dict[int, str] = {}  # slot -> why its constraint cannot go on
        self._bitmask = np.zeros((max_rows, (vocab_size + 31) // 32), dtype=np.int32)
        self._fresh: set[int] = set()  # slots whose bitmask row matches their matcher's state
        self._pending: Future[None] | None = None
        self._thread: ThreadPoolExecutor | None = None  # made on first use: unconstrained workloads start none

    def update_state(self, update: BatchUpdate) -> None:
        if not update.removed and not any(r.params.structured_outputs for r in update.added):
            return
        self._wait()
        for slot in update.removed:
            self._matchers.pop(slot, None)
            self._errors.pop(slot, None)
            self._fresh.discard(slot)
        for row in update.added:
            constraint = row.params.structured_outputs
            if constraint is None:
                continue
            if self.backend is None:
                self._errors[row.slot] = "structured output is unavailable: the model has no tokenizer.json"
                continue
            try:
                matcher = self.backend.matcher(constraint)
                for token in row.output_token_ids:  # a resumed or forked sequence: replay its outputs
                    if not matcher.consume(token):
                        break
            except StructuredOutputError as e:
                self._errors[row.slot] = str(e)
                continue
            self._matchers[row.slot] = matcher

    def bind(self, slots: Sequence[int]) -> BoundStructuredOutput | None:
        if not self._matchers and not self._errors:
            return None
        rows = [row for row, slot in enumerate(slots) if slot in self._matchers or slot in self._errors]
        if not rows:
            return None
        return BoundStructuredOutput(self, rows, [slots[row] for row in rows])

    def is_argmax_invariant(self) -> bool:
        return False

    # ---- the bound form's work ----------------------------------------------------------------------------------
    def masks(self, slots: list[int]) -> np.ndarray:
        """The bitmask rows of `slots` ([len, words] int32), filled now where the background fill did not."""
        self._wait()
        for slot in slots:
            error = self._errors.get(slot) or (self._matchers[slot].error() if slot in self._matchers else None)
            if error is not None:
                raise StructuredOutputError(error)
        stale = [(self._matchers[s], s) for s in slots if s not in self._fresh]
        if stale:
            assert self.backend is not None
            self.backend.fill_masks(stale, self._bitmask)
            self._fresh.update(s for _, s in stale)
        masks = self._bitmask[slots]
        empty = ~masks.any(axis=1)
        if empty.any():
            raise StructuredOutputError("the structured_outputs grammar allows no token at this point of the output")
        return masks

    def advance(self, slots: list[int], tokens: list[int]) -> None:
        """Consumes each row's sampled token (-1: the row failed, skipped), then starts filling the next masks."""
        self._wait()
        advanced = []
        for slot, token in zip(slots, tokens, strict=True):
            matcher = self._matchers.get(slot)
            if matcher is None or token < 0:
                continue
            self._fresh.discard(slot)
            if not matcher.consume(token):
                why = matcher.error() or f"token {token} is not allowed by the structured_outputs grammar"
                self._errors[slot] = why
                continue
            advanced.append((matcher, slot))
        if advanced:
            assert self.backend is not None
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            self._pending = self._thread.submit(self._fill, advanced)

    def _fill(self, matchers: list[tuple[GrammarMatcher, int]]) -> None:
        assert self.backend is not None
        try:
            self.backend.fill_masks(matchers, self._bitmask)
        except Exception:
            return  # NOTE: the rows stay stale: `masks` fills them again and fails the row that raises
        self._fresh.update(slot for _, slot in matchers)

    def _wait(self) -> None:
        """Joins the background fill; every change to matchers or masks happens after it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self._wait()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
