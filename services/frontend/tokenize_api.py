"""vLLM's `/tokenize` and `/detokenize` (same request and response fields): a prompt or a chat (through the chat
template, with tools) to token ids, and ids back to text. Same limits, auth and model check as generation; no
scheduler work."""

from __future__ import annotations

from pydantic import BaseModel

from engine_core.core.prompt_checks import check_token_ids
from services.frontend.openai_protocol import ChatMessageIn, ChatTool, _Request
from services.frontend.pipeline import RequestPipeline
from services.frontend.request import PromptInput, RequestError
from services.frontend.tool_calls import chat_messages


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessageIn]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # NOTE: as vLLM: the template writes its own special tokens
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_input(body: TokenizeCompletionRequest | TokenizeChatRequest) -> PromptInput:
    if isinstance(body, TokenizeCompletionRequest):
        return PromptInput(text=body.prompt, add_special_tokens=body.add_special_tokens)
    if body.add_special_tokens:
        raise RequestError.invalid("add_special_tokens is not supported with messages (the template writes them)")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return PromptInput(
        messages=chat_messages(body.messages),
        tools=tools,
        add_generation_prompt=body.add_generation_prompt,
        field="messages",
    )


async def tokenize(
    pipeline: RequestPipeline, body: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    inp = tokenize_input(body)
    pipeline.limits.check_prompt(inp)  # NOTE: the same size limits as a generation, before tokenizing
    _, ids = await pipeline.encode(inp, check_length=False)
    strs = pipeline.tokenizer.tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=pipeline.model.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(pipeline: RequestPipeline, body: DetokenizeRequest) -> DetokenizeResponse:
    limit = pipeline.limits.max_prompt_chars  # NOTE: at least one character per id: no longer than a text prompt
    if len(body.tokens) > limit:
        raise RequestError.invalid(f"tokens has {len(body.tokens)} ids; the limit is {limit}", "tokens")
    try:
        check_token_ids(body.tokens, pipeline.model.vocab_size, "tokens")
    except ValueError as e:
        raise RequestError.invalid(str(e), "tokens") from e
    return DetokenizeResponse(prompt=await pipeline.decode(body.tokens))
