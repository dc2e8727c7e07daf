"""The fixed admission limits of one engine: whether a request could ever run here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    """Set once when the engine is built and never changed, so `check` is safe from any thread.

    NOTE: the scheduler service checks requests on its event loop while the engine thread runs steps; these values
    are a frozen copy, so that check never reads the scheduler's live state.
    """

    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int

    def check(self, n_prompt: int, n: int) -> None:
        """Raises ValueError if a request with `n_prompt` prompt tokens and `n` choices could never run."""
        if n_prompt == 0:
            raise ValueError("prompt_token_ids must contain at least one token")
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt is {n_prompt} tokens long but max_model_len is {self.max_model_len}: "
                "the prompt must be shorter than max_model_len to leave room for output"
            )
        if -(-n_prompt // self.block_size) > self.num_blocks:
            # NOTE: it could never be admitted, and strict FCFS would block every request behind it forever.
            raise ValueError(
                f"prompt is {n_prompt} tokens long but the KV cache holds only {self.num_blocks} blocks of "
                f"{self.block_size} tokens ({self.num_blocks * self.block_size} tokens)"
            )
        if n > self.max_num_seqs:
            raise ValueError(f"n ({n}) must be <= max_num_seqs ({self.max_num_seqs})")

    def check_beam(self, n_prompt: int, beam_width: int, max_tokens: int | None) -> None:
        """Raises ValueError if a beam search could never run here: its width must fit the batch, and its beams at
        their longest must fit the KV pool (the prompt's blocks shared, each beam's own blocks plus the copy of a
        partial one), so it can always finish even alone."""
        if beam_width > self.max_num_seqs:
            raise ValueError(f"beam_width ({beam_width}) must be <= max_num_seqs ({self.max_num_seqs})")
        new = min(max_tokens or self.max_model_len, self.max_model_len - n_prompt)
        shared = n_prompt // self.block_size
        own = -(-(n_prompt + new) // self.block_size) - shared
        needed = shared + beam_width * own
        if needed > self.num_blocks:
            raise ValueError(
                f"beam_width ({beam_width}) x max_tokens ({new}) needs up to {needed} KV blocks of "
                f"{self.block_size} tokens but the cache holds {self.num_blocks}: lower beam_width or max_tokens"
            )
