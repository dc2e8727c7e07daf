"""The scheduler's per-sequence outputs (engine_core SeqOutput) and finish reasons <-> Protobuf."""

from __future__ import annotations

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from engine_core.core.request import FinishReason
from engine_core.core.seq_output import SeqOutput, TokenLogprobs
from services.rpc import common_pb2, scheduler_pb2

_REASONS: dict[FinishReason, int] = {
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_STRING: common_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FROM_PB = {v: k for k, v in _REASONS.items()}


def reason_to_proto(reason: FinishReason | None) -> int:
    return common_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _REASONS[reason]


def reason_from_proto(value: int) -> FinishReason | None:
    return _FROM_PB.get(value)


def stop_to_proto(stop: int | str | None, out: common_pb2.StopReason) -> None:
    if isinstance(stop, str):
        out.text = stop
    elif isinstance(stop, int):
        out.token_id = stop


def stop_from_proto(msg: common_pb2.StopReason) -> int | str | None:
    kind = msg.WhichOneof("kind")
    return None if kind is None else getattr(msg, kind)


def _lps_to_proto(items: list[TokenLogprobs], out: RepeatedCompositeFieldContainer[common_pb2.TokenLogprobs]) -> None:
    add = out.add  # NOTE: each entry built in place in the repeated field, not built and then copied in
    for item in items:
        add(token_ids=item.token_ids, logprobs=item.logprobs, rank=item.rank)


def _lps_from_proto(items: list[common_pb2.TokenLogprobs]) -> list[TokenLogprobs]:
    return [TokenLogprobs(list(i.token_ids), list(i.logprobs), i.rank) for i in items]


def seq_output_to_proto(out: SeqOutput, msg: scheduler_pb2.SeqOutput | None = None) -> scheduler_pb2.SeqOutput:
    """`out` as Protobuf, built into `msg` when given (an entry of a repeated field: no copy), else a new message."""
    if msg is None:
        msg = scheduler_pb2.SeqOutput()
    msg.index = out.index
    msg.new_token_ids.extend(out.new_token_ids)
    msg.finish_reason = reason_to_proto(out.finish_reason)
    msg.num_cached_tokens = out.num_cached_tokens
    msg.prompt_logprobs_start = out.prompt_logprobs_start
    msg.num_draft_tokens = out.num_draft_tokens
    msg.num_accepted_tokens = out.num_accepted_tokens
    if out.new_logprobs is not None:
        msg.has_new_logprobs = True
        _lps_to_proto(out.new_logprobs, msg.new_logprobs)
    if out.prompt_logprobs is not None:
        msg.has_prompt_logprobs = True
        _lps_to_proto(out.prompt_logprobs, msg.prompt_logprobs)
    stop_to_proto(out.stop_reason, msg.stop_reason)
    if out.cumulative_logprob is not None:
        msg.cumulative_logprob = out.cumulative_logprob
    return msg


def seq_output_from_proto(request_id: str, msg: scheduler_pb2.SeqOutput) -> SeqOutput:
    return SeqOutput(
        request_id=request_id,
        index=msg.index,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=_lps_from_proto(msg.new_logprobs) if msg.has_new_logprobs else None,
        prompt_logprobs=_lps_from_proto(msg.prompt_logprobs) if msg.has_prompt_logprobs else None,
        prompt_logprobs_start=msg.prompt_logprobs_start,
        finish_reason=reason_from_proto(msg.finish_reason),
        stop_reason=stop_from_proto(msg.stop_reason),
        num_cached_tokens=msg.num_cached_tokens,
        num_draft_tokens=msg.num_draft_tokens,
        num_accepted_tokens=msg.num_accepted_tokens,
        cumulative_logprob=msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None,
    )
