"""What the engine core emits per sequence per step: plain Python values, ready for a process boundary."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.core.beam_group import BeamGroup
from engine_core.core.request import FinishReason, Request
from engine_core.plan import LogprobsTensors


@dataclass
class TokenLogprobs:
    """One position: `token_ids[0]` is the chosen token (sampled, or the actual prompt token), then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class SeqOutput:
    request_id: str
    index: int  # choice index
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0  # prompt position of prompt_logprobs[0]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str = ""  # with finish_reason ERROR: why this choice (and so its request) failed
    # Speculative decoding: the request's draft tokens verified and accepted so far (set on a choice's last output).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    cumulative_logprob: float | None = None  # beam search: the returned hypothesis' (its tokens come in one output)


def tensor_rows(tensors: LogprobsTensors, rows: list[int] | slice, k: int) -> list[TokenLogprobs]:
    """Slices rows (and the first 1 + k columns) out of logprob tensors into Python values."""
    ids = tensors.token_ids[rows, : k + 1].tolist()
    lps = tensors.logprobs[rows, : k + 1].tolist()
    ranks = tensors.ranks[rows].tolist()
    return [TokenLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks, strict=True)]


def beam_outputs(group: BeamGroup) -> list[SeqOutput]:
    """A finished beam search's result: one output per returned hypothesis, best first, all its tokens at once."""
    assert group.request is not None
    outputs = []
    for index, hyp in enumerate(group.results()):
        reason = FinishReason.STOP_TOKEN if hyp.stopped else FinishReason.LENGTH
        eos = group.request.sampling_params.eos_token_id
        stop_reason: int | str | None = None
        if hyp.stop_string is not None:
            reason, stop_reason = FinishReason.STOP_STRING, hyp.stop_string
        elif hyp.stopped and hyp.output_token_ids[-1] != eos:
            stop_reason = hyp.output_token_ids[-1]
        outputs.append(
            SeqOutput(
                group.request.request_id,
                index,
                hyp.output_token_ids,
                finish_reason=reason,
                stop_reason=stop_reason,
                num_cached_tokens=max(group.live[0].num_cached_tokens, 0),
                cumulative_logprob=hyp.cum_logprob,
            )
        )
    return outputs


def ending_outputs(request: Request, reason: FinishReason, n: int | None = None) -> list[SeqOutput]:
    """The last output of each choice of a request ended outside a step (abort, error, refused at admission).

    Choices that already finished for another reason were reported then and get none; choices never created
    (siblings of an unforked parent) get one too, so a client sees all `n` choices end (a beam search: the `n` it
    returns, whose indices no beam sequence uses).
    """
    done = {s.index for s in request.seqs if s.is_finished and s.finish_reason is not reason}
    return [
        SeqOutput(request.request_id, index, [], finish_reason=reason)
        for index in range(request.sampling_params.n if n is None else n)
        if index not in done
    ]
