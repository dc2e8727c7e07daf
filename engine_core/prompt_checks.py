"""Prompt checks shared by every entry point (offline LLM, gRPC frontend, scheduler service): one message each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: the scheduler service imports this module and never loads transformers
    from transformers import PreTrainedTokenizerBase


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt_token_ids") -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field} contains ids outside the vocabulary (size {vocab_size}): {bad[:5]}")


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    # NOTE: recent transformers return a BatchEncoding here, older ones a plain list.
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
