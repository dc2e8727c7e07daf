"""Beam search's user-facing parameters and results, named as in vLLM (`BeamSearchParams`, `BeamSearchOutput`).

The search itself runs in the engine (core/beam_scorer.py scores, core/beam_group.py re-forms the sequences); its
semantics are transformers' `generate(num_beams=..., do_sample=False)` (docs/beam_search.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.core.beam_group import BeamGroup
from engine_core.core.beam_stop import BeamStopStrings
from engine_core.core.request import Request
from engine_core.sampling_params import SamplingParams, check_beam_fields, with_eos


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # transformers' meanings: True ends when beam_width hypotheses are finished; False (transformers' default) also
    # when the best running beam can no longer beat the worst finished one at its current length; "never" then
    # assumes the longest length when length_penalty > 0.
    early_stopping: bool | str = False
    n: int | None = None  # how many of the best hypotheses come back; None: all beam_width (vLLM's shape)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        n = self.beam_width if self.n is None else self.n
        check_beam_fields(
            self.beam_width, n, self.max_tokens, self.temperature, self.length_penalty, self.early_stopping
        )
        # The stop fields are checked by SamplingParams (sampling_params(), below).
        self.sampling_params()

    @property
    def num_returned(self) -> int:
        return self.beam_width if self.n is None else self.n

    def sampling_params(self) -> SamplingParams:
        """The per-sequence params the engine runs a beam with: greedy rows, no user logprobs, the stop fields."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


def params_of(params: SamplingParams) -> BeamSearchParams:
    """The beam search a request's SamplingParams ask for (use_beam_search; n returned of beam_width)."""
    if params.max_tokens is None:
        raise ValueError("max_tokens must be set with beam search (use_beam_search)")
    return BeamSearchParams(
        beam_width=params.n if params.beam_width is None else params.beam_width,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=params.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
        early_stopping=params.early_stopping,
        n=params.n,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
    )


def group_for(request: Request, max_model_len: int, decode: Decode | None = None) -> BeamGroup:
    """The group of a request whose params set use_beam_search (EngineCore.add_request); the request keeps its
    params (n = the choices returned), its beams run with the group's `row_params` (eos kept)."""
    user = request.sampling_params
    params = params_of(user)
    row = dataclasses.replace(params.sampling_params(), eos_token_id=user.eos_token_id)
    row = with_beam_candidates(row, params.beam_width)
    return _group(params, row, max_model_len - request.num_prompt_tokens, decode)


# Token ids -> text without special tokens (the tokenizer's decode): what matches `stop` strings during the search.
Decode = Callable[[list[int]], str]


def _group(params: BeamSearchParams, row: SamplingParams, room: int, decode: Decode | None) -> BeamGroup:
    max_new = max(1, min(params.max_tokens, room))
    # NOTE: without a decode (a scheduler with no tokenizer), stop strings only cut the returned text at the end.
    stops = BeamStopStrings(params.stop, decode) if params.stop and decode is not None else None
    return BeamGroup(
        row,
        params.beam_width,
        params.num_returned,
        params.length_penalty,
        params.early_stopping,
        row.all_stop_token_ids,
        max_new,
        stops,
    )


def beam_candidates(beam_width: int, num_stop_tokens: int) -> int:
    """Candidates kept per step, as transformers: enough that beam_width survive even if every beam's best few end
    (each stop token can take one candidate per beam)."""
    return max(2, 1 + num_stop_tokens) * beam_width


def with_beam_candidates(params: SamplingParams, beam_width: int) -> SamplingParams:
    """`params` (with its eos filled) asking the worker for each row's top candidates as logprobs."""
    k = beam_candidates(beam_width, len(params.all_stop_token_ids))
    return dataclasses.replace(params, num_beam_candidates=k)


def beam_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    eos_token_id: int | None,
    vocab_size: int,
    max_model_len: int,
    prompt: str | None = None,
    decode: Decode | None = None,
) -> tuple[Request, BeamGroup]:
    """The engine request of one prompt's beam search and its group (EngineCore.add_request(request, group)).
    Raises ValueError naming the field when a stop token id is outside the vocabulary."""
    sp = with_beam_candidates(with_eos(params.sampling_params(), eos_token_id, vocab_size), params.beam_width)
    group = _group(params, sp, max_model_len - len(prompt_token_ids), decode)
    return Request(request_id, prompt_token_ids, sp, prompt=prompt), group


@dataclass
class BeamSearchSequence:
    """One returned hypothesis, as vLLM's: `tokens` are the prompt's and the generated ones, `text` their text."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty: the order of `sequences`
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
