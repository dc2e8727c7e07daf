"""OpenAI bodies <-> the shared request path: requests to GenerateInputs, stream events to response objects."""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine_core.io.output_processor import ChoiceDelta
from engine_core.io.request_output import PositionLogprobs
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import grammar
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
from services.frontend.openai_structured import structured_outputs
from services.frontend.request import GenerateInput, PromptInput, RequestError, Usage
from services.frontend.tool_calls import ToolPlan, chat_messages

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
    if req.stream and req.prompt_logprobs:
        # NOTE: as vLLM: the HTTP stream has no place for them (gRPC streams them)
        raise RequestError.invalid("prompt_logprobs are not available with stream: true", "prompt_logprobs")
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
    kwargs["structured_outputs"] = structured_outputs(req.response_format, req.structured_outputs)
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
    special, cut = req.add_special_tokens, req.truncate_prompt_tokens
    if isinstance(p, str):
        prompts = [PromptInput(text=p, add_special_tokens=special, truncate_prompt_tokens=cut)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [PromptInput(token_ids=list(p), truncate_prompt_tokens=cut)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [PromptInput(text=x, add_special_tokens=special, truncate_prompt_tokens=cut) for x in p]  # type: ignore[misc]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [PromptInput(token_ids=list(x), truncate_prompt_tokens=cut) for x in p]  # type: ignore[arg-type]
    else:
        raise RequestError.invalid("prompt must be a string, a list of strings, token ids or lists of token ids")
    params = _params(req, req.max_tokens, req.logprobs, req.best_of)
    if req.echo and req.logprobs is not None and params.prompt_logprobs is None and not req.stream:
        params.prompt_logprobs = req.logprobs  # NOTE: as vLLM: echo's logprobs cover the prompt's tokens too
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


def chat_input(
    req: ChatCompletionRequest, trace: TraceContext, request_id: str, tenant: str = "", tools: ToolPlan | None = None
) -> GenerateInput:
    """`tools`: the request's tool plan (services.frontend.tool_calls.plan_tools); None when it has no tools."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise RequestError.invalid("max_completion_tokens and max_tokens are exclusive: set one")
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError.invalid("top_logprobs needs logprobs: true")
    messages = chat_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    if tools is not None and tools.structured_outputs is not None:
        if params.structured_outputs is not None:
            raise RequestError.invalid("tool_choice required or a named function cannot be combined with a constraint")
        if params.use_beam_search:
            raise RequestError.invalid("tool_choice required or a named function is not supported with beam search")
        try:
            # NOTE: a tool's parameters are valid JSON Schema (tool_calls checks the meta-schema) but may use a keyword
            # the grammar engine does not support: that is the request's tools' fault, a 400 before any engine work.
            grammar.check(tools.structured_outputs)
        except ValueError as e:
            raise RequestError.invalid(str(e), "tools") from e
        params.structured_outputs = tools.structured_outputs
    prompt = PromptInput(
        messages=messages,
        tools=tools.template_tools if tools is not None else None,
        add_generation_prompt=req.add_generation_prompt,
        field="messages",
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )
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
