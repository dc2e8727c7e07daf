"""bad_words -> token-id sequences, the form the sampler bans (sample/bad_words.py), as vLLM tokenizes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine_core.sampling_params import MAX_BAD_WORD_TOKENS


def bad_words_token_ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> list[list[int]]:
    """Each word tokenized as it reads at the start of the text and, when that differs, after a space (where most
    tokenizers give a word another first token), so it is banned in both places. `encode` adds no special tokens.

    Raises ValueError naming bad_words when a word is longer than MAX_BAD_WORD_TOKENS tokens.
    """
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(encode(text))
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"bad_words contains a word of {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS}")
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
