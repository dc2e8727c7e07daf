"""SamplingParams: per-request sampling and stopping controls, named as in vLLM, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from dataclasses import dataclass, field

from engine_core.structured_output import grammar as structured_grammar
from engine_core.structured_output.params import StructuredOutputsParams

# NOTE: temperatures below this are treated as greedy, as in vLLM: dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# Bounds on the list fields, checked before any tokenizing or tensor building (every entry point shares them).
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64  # per tokenized bad word
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # larger than any vocabulary served; ids are also checked against the model's
# NOTE: a beam row returns max(2, 1 + stop tokens) x beam_width candidates, all scored each step; a width past this is
# refused before any work (vLLM and transformers set no bound).
MAX_BEAM_WIDTH = 64
# Sampling fields beam search does not use: set to anything but their default, they are refused by name.
_UNUSED_WITH_BEAMS = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "seed",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "bad_words",
    "allowed_token_ids",
    "structured_outputs",
)


def _float32(value: float) -> float:
    """The value as the sampler stores it (float32, rounded to nearest); inf where float32 overflows."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


def _is_int(value: object) -> bool:
    # NOTE: bool is an int subclass; True as n or as a token id is a caller bug, not a value.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


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
    # Words the output must not contain (each banned with and without a leading space, as in vLLM) and, when set,
    # the only tokens a step may sample.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # The output's constraint (JSON schema, regex, choice, grammar, any JSON object): every sampled token keeps the
    # output a prefix of something it accepts (engine_core/structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # Beam search in the engine (vLLM's extension fields; docs/architecture.md, "Beam search"): `n` of the
    # `beam_width` best hypotheses come back (beam_width None: n). Greedy only: temperature must be 0.
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # Filled by the engine, not the user: the eos id of the tokenizer (ignored when ignore_eos), and the bad words as
    # token-id sequences (io/bad_words.py), which is the form the sampler uses.
    eos_token_id: int | None = field(default=None, repr=False)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled by the engine for beam search (engine_core/beam_search.py): the top candidates per row the worker
    # returns as logprobs, beyond the user's MAX_LOGPROBS.
    num_beam_candidates: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            # NOTE: the sampler works in float32: a value must stay finite there (1e39 is not).
            if not _is_number(value) or not math.isfinite(_float32(value)):
                raise bad(name, f"must be a finite number (in float32), got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        # NOTE: > 0 in float32, not only in float64: 1e-300 becomes 0.0 there, which would keep no token at all.
        if not 0 < self.top_p <= 1 or _float32(self.top_p) == 0:
            raise bad("top_p", f"must be in (0, 1] (and not round to 0 in float32), got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0 or _float32(self.repetition_penalty) == 0:
            raise bad(
                "repetition_penalty", f"must be > 0 (and not round to 0 in float32), got {self.repetition_penalty}"
            )
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
            if any(s == "" for s in self.stop):
                raise bad("stop", "must not contain an empty string")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids)):
            raise bad("stop_token_ids", f"must be a list of non-negative integers, got {ids!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", f"must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise bad("logit_bias", f"keys must be non-negative token ids, got {tok!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tok}")
        self._validate_token_lists()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {type(so).__name__}")
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """The checks BeamSearchParams makes (engine_core/beam_search.py), on these fields, and the fields beam search
        does not use refused by name rather than ignored."""
        defaults = SamplingParams()
        for name in _UNUSED_WITH_BEAMS:
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(f"{name} is not supported with beam search (use_beam_search)")
        width = self.n if self.beam_width is None else self.beam_width
        check_beam_fields(width, self.n, self.max_tokens, self.temperature, self.length_penalty, self.early_stopping)

    def _validate_token_lists(self) -> None:
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise ValueError(f"bad_words must be a list of strings, got {type(words).__name__}")
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words has {len(words)} words; at most {MAX_BAD_WORDS} are allowed")
            if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
                raise ValueError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters")
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a list of non-negative integers, got {ids!r:.80}")
            if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids, got {len(ids)}")
        seqs = self.bad_words_token_ids
        if seqs is not None:
            if len(seqs) > 2 * MAX_BAD_WORDS:  # each word with and without a leading space
                raise ValueError(f"bad_words_token_ids has {len(seqs)} sequences; at most {2 * MAX_BAD_WORDS}")
            for seq in seqs:
                if not isinstance(seq, list) or not 1 <= len(seq) <= MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"bad_words_token_ids sequences must hold 1 to {MAX_BAD_WORD_TOKENS} token ids")
                if not all(_is_int(t) and t >= 0 for t in seq):
                    raise ValueError(f"bad_words_token_ids must hold non-negative token ids, got {seq!r:.80}")

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: every token id that reaches the sampler must exist in the vocabulary."""
        fields = (
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for seq in self.bad_words_token_ids or [] for t in seq]),
            ("eos_token_id", [] if self.eos_token_id is None else [self.eos_token_id]),
        )
        for name, ids in fields:
            for tok in ids:
                if not _is_int(tok) or not 0 <= tok < vocab_size:
                    raise ValueError(f"{name} contains token id {tok}, outside the vocabulary (size {vocab_size})")
        if self.allowed_token_ids:
            # NOTE: a request whose every allowed token is always masked could never sample: refused here rather than
            # failed by the sampler. (A multi-token bad word can still mask every allowed token at some step; that
            # row then fails alone, docs/reliability.md.)
            banned = {seq[0] for seq in self.bad_words_token_ids or [] if len(seq) == 1}
            if self.min_tokens > 0:
                banned |= self.all_stop_token_ids
            if banned.issuperset(self.allowed_token_ids):
                raise ValueError("allowed_token_ids are all banned by bad_words or, before min_tokens, stop tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos and self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids


def check_beam_fields(
    beam_width: object,
    n: object,
    max_tokens: object,
    temperature: object,
    length_penalty: object,
    early_stopping: object,
) -> None:
    """Raises ValueError naming the field when these beam search settings are out of range."""
    if not _is_int(beam_width) or not 1 <= beam_width <= MAX_BEAM_WIDTH:  # type: ignore[operator]
        raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {beam_width!r}")
    if not _is_int(n) or not 1 <= n <= beam_width:  # type: ignore[operator]
        raise ValueError(f"n must be an integer in [1, beam_width ({beam_width})], got {n!r}")
    if not _is_int(max_tokens) or max_tokens < 1:  # type: ignore[operator]
        raise ValueError(f"max_tokens must be an integer >= 1 with beam search, got {max_tokens!r}")
    # NOTE: refused, not ignored: the search is deterministic (transformers' do_sample=False). vLLM V1 accepts a
    # temperature and still scores raw logprobs, so it has no effect there either.
    if not _is_number(temperature) or not 0 <= temperature < GREEDY_EPS:  # type: ignore[operator]
        raise ValueError(f"temperature must be 0 with beam search (it is deterministic), got {temperature!r}")
    if not _is_number(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")


def with_eos(
    params: SamplingParams,
    eos_token_id: int | None,
    vocab_size: int,
    bad_words_token_ids: list[list[int]] | None = None,
) -> SamplingParams:
    """A copy of the user's params that knows the model's EOS id and its bad words as token ids (the user's object
    is left untouched). Raises ValueError naming the field when a token id is outside the vocabulary, or when the
    structured_outputs constraint does not compile (checked here, before the request reaches the engine)."""
    copy = dataclasses.replace(params, eos_token_id=eos_token_id, bad_words_token_ids=bad_words_token_ids)
    copy.validate_vocab(vocab_size)
    if copy.structured_outputs is not None:
        structured_grammar.check(copy.structured_outputs)
    return copy
