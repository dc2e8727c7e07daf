"""The frontend's typed request path, shared by the gRPC and the OpenAI HTTP APIs."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.io.output_processor import ChoiceDelta
from engine_core.io.request_output import PositionLogprobs, RequestOutput
from engine_core.sampling_params import SamplingParams
from services.common.trace import TraceContext

if TYPE_CHECKING:
    from services.frontend.tracing import RequestSpan

_FIELD_PATH = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\.[0-9]+|\[[0-9]+\])*")
_BRACKET_INDEX = re.compile(r"\[([0-9]+)\]")


class ErrorCode(enum.Enum):
    """gRPC status names; the HTTP API maps them to status codes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"


class RequestError(Exception):
    """A request the frontend refuses or cannot complete; `param` names the offending field."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> RequestError:
        if param is None:
            # NOTE: messages start with the field they are about ("top_p must be ..."); anything else (a word,
            # a number) is no field name: no param rather than a wrong one.
            first = message.split(" ", 1)[0].rstrip(":")
            param = _BRACKET_INDEX.sub(r".\1", first) if _FIELD_PATH.fullmatch(first) else None
        return cls(ErrorCode.INVALID_ARGUMENT, message, param)


@dataclass
class ChatToolCall:
    """A tool call of an earlier assistant message; `arguments` parsed from its JSON, as templates read it."""

    id: str
    name: str
    arguments: object


@dataclass
class ChatMessage:
    role: str
    content: str
    tool_calls: list[ChatToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


@dataclass
class PromptInput:
    """Exactly one of text, token_ids or messages. `field` is how the API calls the input (for errors)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, object]] | None = None  # the chat template's `tools`: OpenAI tool definitions as JSON
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    field: str = "prompt"
    truncate_prompt_tokens: int | None = None  # keep the last k tokens (-1: max_model_len), as vLLM


@dataclass
class GenerateInput:
    prompt: PromptInput
    params: SamplingParams
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    trace: TraceContext = field(default_factory=TraceContext)
    stream: bool = True  # the caller streams (for the trace; the pipeline streams either way)
    tenant: str = ""  # who submitted it (services.frontend.auth): owns it for Abort, may salt the prefix cache


@dataclass
class PreparedRequest:
    """Validated and tokenized: ready for the scheduler."""

    request_id: str
    prompt_text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with the model's eos_token_id
    priority: int
    cache_salt: str | None
    trace: TraceContext
    arrival_ns: int
    arrival_monotonic: float
    span: RequestSpan | None = None  # only when tracing is on
    tenant: str = ""
    stream: bool = True  # the caller streams: the final output need not keep every step's logprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Timings:
    queue_s: float
    ttft_s: float
    e2e_s: float


@dataclass
class FinalInfo:
    output: RequestOutput  # cumulative: every choice's text, token ids, finish reason
    usage: Usage
    timings: Timings
    error: str = ""


@dataclass
class StreamEvent:
    request_id: str
    deltas: list[ChoiceDelta]
    # Prompt logprobs not sent before: positions [prompt_logprobs_start, prompt_logprobs_start + len).
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    final: FinalInfo | None = None
    first: bool = False  # the first event of the stream


@dataclass(frozen=True)
class ModelDescription:
    """The served model, as the scheduler (its workers) and the frontend's tokenizer describe it."""

    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    eos_token_id: int | None
    has_chat_template: bool
