"""SpeculativeConfig: vLLM's `speculative_config` keys, parsed into a typed, validated dataclass at start-up."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

# vLLM's methods (an unknown one fails at start-up, by name).
METHODS = ("ngram", "suffix", "draft_model")
# NOTE: the suffix proposer narrows its match one token at a time up to the depth: bounded per step.
MAX_SUFFIX_TREE_DEPTH = 64
# NOTE: a verification step's rows grow with k (1 + k query tokens per sequence): bounded per step.
MAX_SPECULATIVE_TOKENS = MAX_SUFFIX_TREE_DEPTH
# num_speculative_tokens when not given, for ngram and draft_model (suffix: its tree depth, as vLLM's suffix method).
# NOTE: measured, docs/decisions.md "Speculative decoding" (draft length).
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# NOTE: the proposer compares every window of the sequence once per n-gram length it tries: bounded per step.
MAX_PROMPT_LOOKUP = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # None: DEFAULT_NUM_SPECULATIVE_TOKENS, or for suffix suffix_decoding_max_tree_depth (vLLM's rule); the suffix
    # method's drafts are adaptive within it (<= max_spec_factor x match length, match + draft <= tree depth).
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int = 4  # longest n-gram matched (ngram)
    prompt_lookup_min: int = 2  # shortest n-gram matched (ngram)
    # NOTE: vLLM's key; a decode step of more rows than this proposes nothing: verifying drafts pays off where a step
    # is bound by streaming the weights (few rows), not where it is already compute-bound (docs/decisions.md,
    # "Speculative decoding").
    disable_by_batch_size: int = 4
    # suffix (vLLM's keys and defaults): match + draft length, how many finished requests' outputs are kept (0: none),
    # draft length <= factor * match length, the least path probability (by counts) a drafted token may have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: the draft's path or hub id (vLLM's key), a smaller model with the target's tokenizer.
    model: str | None = None

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{key} {why}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {METHODS}, got {self.method!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model.strip()):
            raise bad("model", "must name the draft model (a path or hub id) for method 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise bad("model", f"is only read by method 'draft_model', not {self.method!r}")
        if self.num_speculative_tokens is None:
            depth = self.suffix_decoding_max_tree_depth
            valid = _is_int(depth) and 2 <= depth <= MAX_SUFFIX_TREE_DEPTH  # else its own check below names it
            k = depth if self.method == "suffix" and valid else DEFAULT_NUM_SPECULATIVE_TOKENS
            object.__setattr__(self, "num_speculative_tokens", k)  # NOTE: frozen; resolved once, here
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, key)
            if not _is_int(value) or value < 1:
                raise bad(key, f"must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise bad(
                "num_speculative_tokens", f"must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise bad("prompt_lookup_max", f"must be <= {MAX_PROMPT_LOOKUP}, got {self.prompt_lookup_max}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"({self.prompt_lookup_min}) must be <= prompt_lookup_max")
        depth = self.suffix_decoding_max_tree_depth
        if not _is_int(depth) or not 2 <= depth <= MAX_SUFFIX_TREE_DEPTH:
            raise bad(
                "suffix_decoding_max_tree_depth", f"must be an integer in [2, {MAX_SUFFIX_TREE_DEPTH}], got {depth!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or cached < 0:
            raise bad("suffix_decoding_max_cached_requests", f"must be an integer >= 0, got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if not _is_number(factor) or not 0 < factor <= MAX_SPECULATIVE_TOKENS:
            raise bad(
                "suffix_decoding_max_spec_factor", f"must be a number in (0, {MAX_SPECULATIVE_TOKENS}], got {factor!r}"
            )
        prob = self.suffix_decoding_min_token_prob
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise bad("suffix_decoding_min_token_prob", f"must be a number in [0, 1], got {prob!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From what a user passes (LLM(speculative_config={...}), --speculative-config '<json>'); None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]
