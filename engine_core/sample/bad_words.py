"""bad_words: a word's last token is banned wherever the output so far ends with the word's other tokens.

The words arrive as token-id sequences (`SamplingParams.bad_words_token_ids`, tokenized by the entry point that has
the tokenizer: io/bad_words.py). Matching runs on the host over the rows that have bad words only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor


def banned_tokens(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of `words` after `output` (vLLM's bad-words rule)."""
    banned = []
    n = len(output)
    for word in words:
        prefix_len = len(word) - 1
        if prefix_len <= n and list(output[n - prefix_len :]) == list(word[:-1]):
            banned.append(word[-1])
    return banned


class BoundBadWords(BoundProcessor):
    needs_host_tokens = True

    def __init__(self, processor: BadWordsProcessor, rows: list[tuple[int, int]]) -> None:
        self.processor = processor
        self.rows = rows  # (row, slot) of the rows with bad words

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        ids: list[int] = []
        for row, slot in self.rows:
            banned = banned_tokens(self.processor.words[slot], self.processor.outputs[slot])
            rows += [row] * len(banned)
            ids += banned
        if rows:
            dev = logits.device
            index = (
                torch.tensor(rows, dtype=torch.int64, device=dev),
                torch.tensor(ids, dtype=torch.int64, device=dev),
            )
            logits.index_put_(index, torch.tensor(float("-inf"), device=dev))
        return logits

    def record(self, tokens: torch.Tensor, host_tokens: np.ndarray | None) -> None:
        assert host_tokens is not None, "needs_host_tokens: the sampling batch reads them back"
        values = host_tokens.tolist()
        for row, slot in self.rows:
            if values[row] >= 0:  # a failed row's -1 is no output
                self.processor.outputs[slot].append(values[row])


class BadWordsProcessor(LogitsProcessor):
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int) -> None:
        super().__init__(vocab_size, device, max_rows)
        self.words: dict[int, list[list[int]]] = {}  # slot -> token sequences
        self.outputs: dict[int, list[int]] = {}  # slot -> output tokens so far (rows with bad words only)

    def update_state(self, update: BatchUpdate) -> None:
        for slot in update.removed:
            self.words.pop(slot, None)
            self.outputs.pop(slot, None)
        for row in update.added:
            words = row.params.bad_words_token_ids
            if words:
                self.words[row.slot] = [list(w) for w in words]
                self.outputs[row.slot] = list(row.output_token_ids)

    def bind(self, slots: Sequence[int]) -> BoundBadWords | None:
        if not self.words:
            return None
        rows = [(row, slot) for row, slot in enumerate(slots) if slot in self.words]
        return BoundBadWords(self, rows) if rows else None

    def is_argmax_invariant(self) -> bool:
        return False
