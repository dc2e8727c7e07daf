"""OpenAI bodies <-> the shared request path: requests to GenerateInputs, stream events to response objects."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine_core.io.output_processor import ChoiceDelta
from engine_core.io.request_output import PositionLogprobs
from engine_core.sampling_params import SamplingParams
from services.common.trace import TraceContext
from services.frontend.openai_protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from services.frontend.request import ChatMessage, GenerateInput, PromptInput, RequestError, Usage

_TOKEN_ID = re.compile(r"0|-?[1-9][0-9]*")
_PASSTHROUGH = (
    "n",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
    "bad_words",
    "allowed_token_ids",
    "length_penalty",
    "early_stopping",
)


def _params(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    beam_width: int | None = None,
) -> SamplingParams:
    kwargs: dict[str, object] = {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    if req.use_beam_search:
        kwargs["use_beam_search"] = True
        kwargs["beam_width"] = beam_width
        kwargs.setdefault("temperature", 0.0)  # NOTE: unset means greedy: beam search is deterministic
    else:
        kwargs.pop("length_penalty", None)
        kwargs.pop("early_stopping", None)
    if req.stop is not None:
        kwargs["stop"] = req.stop
    if req.logit_bias:
        for key in req.logit_bias:
            # NOTE: int() also reads " 5 ", "1_0" and non-ASCII digits: only the canonical decimal form is a token id.
            if _TOKEN_ID.fullmatch(key) is None:
                raise RequestError.invalid(f"logit_bias keys must be token ids in decimal, got {key!r}", "logit_bias")
        kwargs["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise RequestError.invalid(str(e)) from e


def completion_inputs(
    req: CompletionRequest, trace: TraceContext, request_id: str, tenant: str = "", max_prompts: int | None = None
) -> list[GenerateInput]:
    """One input per prompt (the completions API takes a batch of prompts)."""
    if req.suffix is not None:
        raise RequestError.invalid("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise RequestError.invalid("best_of must equal n (best-of sampling is not supported)", "best_of")
    p = req.prompt
    batch = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
    if max_prompts is not None and batch and len(p) > max_prompts:
        raise RequestError.invalid(f"prompt has {len(p)} prompts; the limit is {max_prompts}", "prompt")
    prompts: list[PromptInput]
    if isinstance(p, str):
        prompts = [PromptInput(text=p, add_special_tokens=req.add_special_tokens)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [PromptInput(token_ids=list(p))]  # type: ignore[arg-type]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [PromptInput(text=x, add_special_tokens=req.add_special_tokens) for x in p]  # type: ignore[misc]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [PromptInput(token_ids=list(x)) for x in p]  # type: ignore[arg-type]
    else:
        raise RequestError.invalid("prompt must be a string, a list of strings, token ids or lists of token ids")
    params = _params(req, req.max_tokens, req.logprobs, req.best_of)
    return [
        GenerateInput(
            prompt,
            params,
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}",
            priority=req.priority,
            cache_salt=req.cache_salt,
            trace=trace,
            stream=bool(req.stream),
            tenant=tenant,
        )
        for i, prompt in enumerate(prompts)
    ]


def chat_input(req: ChatCompletionRequest, trace: TraceContext, request_id: str, tenant: str = "") -> GenerateInput:
    if req.tools or req.tool_choice not in (None, "none"):
        raise RequestError.invalid("tools are not supported")
    if req.response_format is not None and req.response_format.get("type") not in (None, "text"):
        raise RequestError.invalid("response_format: only {'type': 'text'} is supported")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise RequestError.invalid("max_completion_tokens and max_tokens are exclusive: set one")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError.invalid("top_logprobs needs logprobs: true")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        messages.append(ChatMessage(m.role, content or ""))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    prompt = PromptInput(messages=messages, add_generation_prompt=req.add_generation_prompt, field="messages")
    return GenerateInput(
        prompt, params, request_id, req.priority, req.cache_salt, trace, tenant=tenant, stream=bool(req.stream)
    )


def usage_info(usages: list[Usage]) -> UsageInfo:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _chosen(pos: PositionLogprobs) -> tuple[int, float, str]:
    tok, lp = next(iter(pos.items()))  # NOTE: the chosen token is always the first entry
    return tok, lp.logprob, lp.decoded_token or ""


@dataclass
class CompletionLogprobsBuilder:
    """Completions-API logprobs of one choice; tracks the text offset across streamed chunks."""

    offset: int = 0

    def build(self, positions: list[PositionLogprobs]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for pos in positions:
            _, lp, token = _chosen(pos)
            out.tokens.append(token)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({(v.decoded_token or ""): v.logprob for v in pos.values()})
            out.text_offset.append(self.offset)
            self.offset += len(token)
        return out


def chat_logprobs(positions: list[PositionLogprobs], top_k: int) -> ChatLogprobs:
    content = []
    for pos in positions:
        _, lp, token = _chosen(pos)
        # NOTE: the entries are the chosen token (its true rank) and the top-k; ranks 1..k are the top-k.
        ranked = sorted((v for v in pos.values() if v.rank is not None and v.rank <= top_k), key=lambda v: v.rank or 0)
        tops = [
            TopLogprob(token=v.decoded_token or "", logprob=v.logprob, bytes=_bytes(v.decoded_token)) for v in ranked
        ]
        content.append(ChatTokenLogprob(token=token, logprob=lp, bytes=_bytes(token), top_logprobs=tops))
    return ChatLogprobs(content=content)


def _bytes(token: str | None) -> list[int]:
    return list((token or "").encode("utf-8"))


def finish_fields(delta: ChoiceDelta) -> tuple[str | None, int | str | None]:
    if delta.finish_reason is None:
        return None, None
    return delta.finish_reason.openai, delta.stop_reason
