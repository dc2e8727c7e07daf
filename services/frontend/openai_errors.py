"""Errors FastAPI raises before a handler runs (body parsing, validation, unknown routes) as OpenAI error objects.

`param` is the field's dotted path in the body (`messages.0.content`); pydantic's own words never become a param:
its union member tags (`str`, `list[int]`) are dropped from the path, and errors about the body as a whole (not
JSON, not an object, missing) have no param.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from services.frontend.openai_protocol import (
    ChatCompletionRequest,
    ChatContentPart,
    ChatMessageIn,
    ChatTool,
    CompletionRequest,
    ErrorDetail,
    ErrorResponse,
    FunctionCallIn,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    StreamOptions,
    ToolCallIn,
)
from services.frontend.request import ErrorCode, RequestError
from services.frontend.tokenize_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessageIn,
    ChatContentPart,
    StreamOptions,
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
    NamedFunction,
    ToolCallIn,
    FunctionCallIn,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
_FIELD_NAMES = frozenset(name for model in _MODELS for name in model.model_fields)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")


def _path(error: dict[str, Any]) -> str | None:
    if error.get("type") == "json_invalid":
        return None  # loc is a character position
    loc: Sequence[int | str] = error.get("loc", ())
    if loc and loc[0] == "body":
        loc = loc[1:]
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(str(item))
        elif item in _FIELD_NAMES:
            parts.append(item)
        elif error.get("type") == "extra_forbidden" and i == len(loc) - 1:
            if _NAME.fullmatch(item):  # NOTE: the client's own word: echoed only when it looks like a field name
                parts.append(item)
            else:
                return None
        elif parts and parts[-1] == "logit_bias" and _TOKEN_ID.fullmatch(item):
            parts.append(item)  # a key of the map, when it is a token id
        # else: a pydantic union tag such as "str" or "list[ChatContentPart]": not part of the field's path
    return ".".join(parts) or None


def _reason(error: dict[str, Any]) -> str:
    return str(error["msg"]).removeprefix("Value error, ")


def validation_error(exc: RequestValidationError) -> RequestError:
    """The failing field, with every reason pydantic gave for it. A value no member of a union accepts fails once per
    member: the deepest path wins (a list whose element is wrong names the element), reasons at it are joined."""
    errors = list(exc.errors())
    if not errors:
        return RequestError(ErrorCode.INVALID_ARGUMENT, "the request body is invalid", None)
    first = errors[0]
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return RequestError(ErrorCode.INVALID_ARGUMENT, f"the request body is not valid JSON: {reason}{where}", None)
    param = _path(first)
    if param is None:
        if first.get("type") == "extra_forbidden":
            message = f"the request has an unknown field {str(first['loc'][-1])[:64]!r}"
        else:
            message = f"the request body must be a JSON object with the request's fields: {_reason(first)}"
        return RequestError(ErrorCode.INVALID_ARGUMENT, message, None)
    top = param.split(".", 1)[0]
    paths = [(p, e) for e in errors if (p := _path(e)) is not None and p.split(".", 1)[0] == top]
    param = max((p for p, _ in paths), key=lambda p: p.count("."))
    reasons = list(dict.fromkeys(_reason(e) for p, e in paths if p == param))
    return RequestError(ErrorCode.INVALID_ARGUMENT, f"{param}: {' or '.join(reasons)}", param)


def http_error_body(status: int, detail: str) -> ErrorResponse:
    """Starlette's own refusals (no such route, wrong method) in the OpenAI shape, with Starlette's status."""
    kind = "not_found" if status == 404 else "invalid_request_error" if status < 500 else "internal"
    return ErrorResponse(error=ErrorDetail(message=detail, type=kind, param=None, code=status))


HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
}


def error_body(e: RequestError) -> ErrorResponse:
    kind = "invalid_request_error" if e.code is ErrorCode.INVALID_ARGUMENT else e.code.value.lower()
    return ErrorResponse(error=ErrorDetail(message=e.message, type=kind, param=e.param, code=HTTP_STATUS[e.code]))


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(e).model_dump(), status_code=HTTP_STATUS[e.code])
