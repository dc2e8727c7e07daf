"""vLLM's additions to OpenAI's response bodies: `prompt_logprobs`, echo's prompt logprobs, `return_token_ids`'s
ids and `stream_options.continuous_usage_stats`' running usage."""

from __future__ import annotations

from engine_core.io.request_output import PositionLogprobs
from services.frontend.openai_convert import CompletionLogprobsBuilder
from services.frontend.openai_protocol import (
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    StreamOptions,
    UsageInfo,
)


def prompt_logprobs_body(positions: list[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's shape: per prompt position (the first null) token id -> {logprob, rank, decoded_token}."""
    if positions is None:
        return None
    return [
        None
        if pos is None
        else {
            tok: PromptLogprob(logprob=v.logprob, rank=v.rank, decoded_token=v.decoded_token) for tok, v in pos.items()
        }
        for pos in positions
    ]


def echo_logprobs(
    builder: CompletionLogprobsBuilder, first_token: str, positions: list[PositionLogprobs | None]
) -> CompletionLogprobs:
    """The completions API's logprobs of an echoed prompt (as vLLM: the first token has none), with the offsets
    running on into the completion's (the same builder builds those next)."""
    out = CompletionLogprobs(tokens=[first_token], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    builder.offset = len(first_token)
    rest = builder.build([p for p in positions[1:] if p is not None])
    return joined(out, rest)


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


def continuous_usage(options: StreamOptions | None) -> bool:
    # NOTE: as vLLM: running usage in every chunk only together with include_usage.
    return options is not None and options.include_usage and options.continuous_usage_stats


def running_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
