"""Prompt checks shared by every entry point (offline LLM, gRPC frontend, scheduler service): one message each."""

from __future__ import annotations

from collections.abc import Sequence


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt_token_ids") -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field} contains ids outside the vocabulary (size {vocab_size}): {bad[:5]}")
