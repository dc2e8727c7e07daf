"""SamplingParams: per-request sampling and stopping controls, named as in vLLM, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# NOTE: temperatures below this are treated as greedy, as in vLLM: dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top alternatives per sampled token (the sampled one is always included)
    prompt_logprobs: int | None = None
    # Filled by the engine, not the user: the eos id of the tokenizer (ignored when ignore_eos).
    eos_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise bad("stop", f"must be a string or a list of strings, got {type(self.stop).__name__}")
            if any(s == "" for s in self.stop):
                raise bad("stop", "must not contain an empty string")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
                raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    raise bad("logit_bias", f"keys must be non-negative token ids, got {tok!r}")
                if not -100 <= bias <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids or []), ("logit_bias", list(self.logit_bias or {}))):
            for tok in ids:
                if tok >= vocab_size:
                    raise ValueError(f"{name} contains token id {tok}, outside the vocabulary (size {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos and self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids
