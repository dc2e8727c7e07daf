"""OpenAI tools in the chat API: the request's `tools`/`tool_choice` checked and planned, earlier calls and tool
results taken into the chat, and each choice's output read back into `tool_calls`.

- `tool_choice` `none`: the template still sees the tools (as vLLM); the output is content.
- `auto` (the default when tools are given, as in vLLM): needs `--enable-auto-tool-choice` and a
  `--tool-call-parser`; the model writes calls in its own format and the parser finds them (tool_parsers/).
- `required` and a named function: enforced by grammar. The request gets `structured_outputs.json`: the named
  function's parameters, or for `required` vLLM's schema (an array of at least one `{"name", "parameters"}`, one
  branch per tool; at most one item when `parallel_tool_calls` is false). The structured-output engine enforces it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema

from engine_core.structured_output.params import StructuredOutputsParams
from services.frontend.limits import ApiLimits
from services.frontend.openai_protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    ChatTool,
    FunctionCallDelta,
    FunctionCallIn,
    FunctionCallOut,
    ToolCallDeltaOut,
    ToolCallOut,
)
from services.frontend.request import ChatMessage, ChatToolCall, RequestError
from services.frontend.tool_parsers import TOOL_PARSERS, ParsedPiece, ToolCall, ToolParser, collect
from services.frontend.tool_parsers.forced import NamedToolParser, RequiredToolParser

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_SCHEMA_DEPTH = 32  # nesting of a parameters schema: deeper ones are refused before any schema check
_EMPTY_PARAMETERS: dict[str, object] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The operator's choice (vLLM's flags): whether `tool_choice: auto` is served, and with which parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its sampling and its output."""

    template_tools: list[dict[str, object]] | None = None  # for the chat template
    structured_outputs: StructuredOutputsParams | None = None  # required / named: the grammar of the call
    new_parser: Callable[[], ToolParser] | None = None  # None: the output is plain content
    max_calls: int | None = None  # parallel_tool_calls false: 1
    finish_as_tool_calls: bool = False  # a choice that called a tool and stopped finishes with "tool_calls"


def plan_tools(req: ChatCompletionRequest, settings: ToolSettings, limits: ApiLimits) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise RequestError.invalid("tool_choice needs tools", "tool_choice")
        return ToolPlan()
    _check_tools(tools, limits)
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan(template_tools)
    if choice is None or choice == "auto":
        parser = settings.tool_call_parser
        if not settings.enable_auto_tool_choice or parser is None:
            raise RequestError.invalid(
                'tool_choice "auto" (the default with tools) needs the server to run with --enable-auto-tool-choice '
                'and --tool-call-parser; send tool_choice "none", "required" or a named function',
                "tool_choice",
            )
        return ToolPlan(template_tools, None, TOOL_PARSERS[parser], max_calls, finish_as_tool_calls=True)
    if choice == "required":
        schema = required_schema(tools, max_calls)
        return ToolPlan(template_tools, StructuredOutputsParams(json=schema), RequiredToolParser, max_calls, True)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise RequestError.invalid(f"tool_choice names function {name[:64]!r}, which is not in tools", "tool_choice")
    schema = tool.function.parameters or _EMPTY_PARAMETERS
    return ToolPlan(template_tools, StructuredOutputsParams(json=schema), lambda: NamedToolParser(name), 1)


def required_schema(tools: list[ChatTool], max_calls: int | None = None) -> dict[str, object]:
    """vLLM's schema for `tool_choice: required`: a non-empty array whose items are one of the tools' calls; the
    tools' `$defs` are hoisted to the top (a `$ref` inside an item must still resolve)."""
    items = []
    defs: dict[str, object] = {}
    for i, tool in enumerate(tools):
        params = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for key, value in dict(params.pop("$defs", None) or {}).items():  # type: ignore[call-overload]
            if key in defs and defs[key] != value:
                raise RequestError.invalid(
                    f"tools.{i}.function.parameters: $defs {key!r} differs from another tool's", f"tools.{i}"
                )
            defs[key] = value
        name = {"type": "string", "enum": [tool.function.name]}
        items.append({"properties": {"name": name, "parameters": params}, "required": ["name", "parameters"]})
    schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def _check_tools(tools: list[ChatTool], limits: ApiLimits) -> None:
    if len(tools) > limits.max_tools:
        raise RequestError.invalid(f"tools has {len(tools)} tools; the limit is {limits.max_tools}", "tools")
    chars = len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))
    if chars > limits.max_tools_chars:
        raise RequestError.invalid(f"tools is {chars} characters of JSON; the limit is {limits.max_tools_chars}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _NAME.fullmatch(fn.name):
            raise RequestError.invalid(
                f"tools.{i}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {fn.name[:80]!r}",
                f"tools.{i}.function.name",
            )
        if fn.name in seen:
            raise RequestError.invalid(f"tools.{i}.function.name {fn.name!r} is given twice")
        seen.add(fn.name)
        if fn.parameters is not None:
            _check_schema(fn.parameters, f"tools.{i}.function.parameters")


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON value, counted no further than `limit` + 1."""
    stack: list[tuple[object, int]] = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            break
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def _check_schema(schema: dict[str, object], param: str) -> None:
    # NOTE: depth first: the meta-schema check recurses, and a hostile schema must not reach Python's stack limit.
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise RequestError.invalid(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise RequestError.invalid(
            f"{param} is not a valid JSON schema: {e.message[:200]}" + (f" (at {where[:100]})" if where else ""), param
        ) from None


# ---- chat history --------------------------------------------------------------------------------------------------
def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """The request's messages for the chat template: an assistant's earlier calls with their arguments parsed (as
    vLLM gives them to templates, which write them with `tojson`), a tool message's `tool_call_id`."""
    out = []
    for i, m in enumerate(messages):
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        calls = None
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise RequestError.invalid(f"messages.{i}.tool_calls: only assistant messages have tool calls")
            where = f"messages.{i}.tool_calls"
            calls = [_earlier_call(c.id, c.function, f"{where}.{j}") for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None and m.role != "tool":
            raise RequestError.invalid(f"messages.{i}.tool_call_id: only tool messages answer a tool call")
        out.append(ChatMessage(m.role, content or "", calls, m.tool_call_id, m.name))
    return out


def _earlier_call(call_id: str, fn: FunctionCallIn, param: str) -> ChatToolCall:
    try:
        arguments = json.loads(fn.arguments)
    except ValueError as e:
        raise RequestError.invalid(f"{param}.function.arguments is not valid JSON: {e}") from None
    return ChatToolCall(call_id, fn.name, arguments)


# ---- output --------------------------------------------------------------------------------------------------------
class ChoiceTools:
    """One choice's output read through the plan's parser: content, tool calls, finish reason."""

    def __init__(self, plan: ToolPlan) -> None:
        assert plan.new_parser is not None
        self.plan = plan
        self.parser = plan.new_parser()
        self.called = False

    def feed(self, text: str, finished: bool) -> ParsedPiece:
        piece = self.parser.feed(text)
        if finished:
            piece += self.parser.finish()
        if self.plan.max_calls is not None:
            piece.calls = [d for d in piece.calls if d.index < self.plan.max_calls]
        self.called = self.called or bool(piece.calls)
        return piece

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.called and self.plan.finish_as_tool_calls else reason


def whole_message(
    plan: ToolPlan, text: str, reason: str | None
) -> tuple[str | None, list[ToolCallOut] | None, str | None]:
    """(content, tool_calls, finish_reason) of a non-streamed choice."""
    tools = ChoiceTools(plan)
    content, calls = collect([tools.feed(text, finished=True)])
    if not calls:
        return content, None, reason
    out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    # NOTE: as OpenAI: a message that only calls tools has content null.
    return (content if content.strip() else None), out, tools.finish_reason(reason)


def delta_calls(piece: ParsedPiece) -> list[ToolCallDeltaOut] | None:
    if not piece.calls:
        return None
    return [
        ToolCallDeltaOut(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=FunctionCallDelta(name=d.name, arguments=d.arguments),
        )
        for d in piece.calls
    ]


__all__ = ["ChoiceTools", "ToolCall", "ToolPlan", "ToolSettings", "chat_messages", "plan_tools", "whole_message"]
