"""Chat requests with tools: what they become (the structured-output constraint of required / named, the template's
tools, the chat history) and the 400s naming the field, over the real HTTP server (no scheduler behind it: a request
that passes every check gets 503)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from engine_core.io.tokenizer import Tokenizer
from services.common.trace import TraceContext
from services.frontend.http_guard import HttpConnectionLimits
from services.frontend.limits import ApiLimits
from services.frontend.openai_convert import chat_input
from services.frontend.openai_protocol import ChatCompletionRequest
from services.frontend.request import RequestError
from services.frontend.tool_calls import ToolSettings, plan_tools, whole_message
from tests.services.http_frontend import http_frontend, post_json

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def _plan(body: dict[str, Any], settings: ToolSettings = AUTO) -> Any:
    req = ChatCompletionRequest.model_validate({"messages": USER, **body})
    plan = plan_tools(req, settings, ApiLimits())
    return plan, chat_input(req, TraceContext(), "r", tools=plan)


def test_named_function_constrains_to_its_parameters() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    plan, inp = _plan({"tools": [WEATHER, TIME], "tool_choice": choice})
    so = inp.params.structured_outputs
    assert so is not None and so.json == WEATHER["function"]["parameters"]
    assert inp.prompt.tools == [WEATHER, TIME]
    # the output (whatever the grammar let through) is the call's arguments; finish_reason stays "stop" (vLLM)
    content, calls, reason = whole_message(plan, '{"city": "Paris"}', "stop")
    assert content is None and reason == "stop" and calls is not None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_required_builds_vllms_array_schema() -> None:
    plan, inp = _plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    so = inp.params.structured_outputs
    assert so is not None and isinstance(so.json, dict)
    schema = so.json
    assert schema["$defs"] == {"unit": {"enum": ["celsius", "fahrenheit"]}}  # hoisted: the $ref resolves
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = jsonschema.Draft202012Validator(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
        {"name": "get_time", "parameters": {}},
    ]
    assert valid.is_valid(good)
    assert not valid.is_valid([])  # at least one call
    assert not valid.is_valid([{"name": "nope", "parameters": {}}])
    assert not valid.is_valid([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}])
    content, calls, reason = whole_message(plan, json.dumps(good), "stop")
    assert content is None and reason == "tool_calls" and calls is not None
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    # parallel_tool_calls false: one call at most
    _, single = _plan({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert single.params.structured_outputs is not None
    assert not jsonschema.Draft202012Validator(single.params.structured_outputs.json).is_valid(good)


def test_auto_and_none_leave_sampling_alone_and_read_the_models_calls() -> None:
    plan, inp = _plan({"tools": [WEATHER]})  # auto is the default with tools
    assert inp.params.structured_outputs is None and plan.new_parser is not None
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls, reason = whole_message(plan, text, "stop")
    assert content == "Sure." and reason == "tool_calls" and calls is not None
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert whole_message(plan, text, "length")[2] == "length"
    plan, inp = _plan({"tools": [WEATHER], "tool_choice": "none"})
    assert plan.new_parser is None and inp.prompt.tools == [WEATHER]


def test_history_with_calls_and_results() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    inp = chat_input(req, TraceContext(), "r", tools=plan_tools(req, AUTO, ApiLimits()))
    assert inp.prompt.messages is not None
    assistant, tool = inp.prompt.messages[1], inp.prompt.messages[2]
    assert assistant.tool_calls is not None and assistant.tool_calls[0].arguments == {"city": "Paris"}  # parsed
    assert tool.tool_call_id == "call_1" and tool.content == "18 C"


@pytest.fixture(scope="module")
def port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(30.0, 30.0, 0, 0), AUTO) as p:
        yield p


@pytest.fixture(scope="module")
def port_without_auto(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(30.0, 30.0, 0, 0)) as p:
        yield p


def _tool(name: str = "f", parameters: object = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def _deep(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


NAMED_G = {"type": "function", "function": {"name": "g"}}
CUT_ARGS = {"name": "f", "arguments": "{"}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("schema not a schema", {"tools": [_tool(parameters={"type": "objekt"})]}, "tools.0.function.parameters"),
    ("schema keyword, wrong type", {"tools": [_tool(parameters={"required": "x"})]}, "tools.0.function.parameters"),
    ("schema nested too deep", {"tools": [_tool(parameters=_deep(40))]}, "tools.0.function.parameters"),
    ("bad function name", {"tools": [_tool("get weather")]}, "tools.0.function.name"),
    ("duplicate name", {"tools": [_tool("f"), _tool("f")]}, "tools.1.function.name"),
    ("too many tools", {"tools": [_tool(f"f{i}") for i in range(129)]}, "tools"),
    ("no type", {"tools": [{"function": {"name": "f"}}]}, "tools.0.type"),
    ("unknown tool field", {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools.0.function.x"),
    ("choice names no tool", {"tools": [_tool()], "tool_choice": NAMED_G}, "tool_choice"),
    ("choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("unknown choice", {"tools": [_tool()], "tool_choice": "always"}, "tool_choice"),
    ("surrogate in a tool name", {"tools": [_tool("\ud800")]}, "tools.0.function.name"),
    (
        "arguments not JSON",
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": CUT_ARGS}]}]},
        "messages.0.tool_calls.0.function.arguments",
    ),
    (
        "history over max_prompt_chars",
        {"messages": [{"role": "tool", "tool_call_id": "c" * 300_000, "content": "x"}]},
        "messages",
    ),
    (
        "tool_calls on a user message",
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages.0.tool_calls",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_tools_are_400_naming_the_field(port: int, case: str, body: dict[str, Any], param: str) -> None:
    raw = json.dumps({"messages": USER, **body}).encode()  # NOTE: json escapes a lone surrogate as \ud800
    status, reply = post_json(port, "/v1/chat/completions", raw)
    assert status == 400, (case, reply)
    assert reply["error"]["param"] == param, (case, reply)
    assert reply["error"]["type"] == "invalid_request_error"


def test_valid_tool_requests_get_past_every_check(port: int, port_without_auto: int) -> None:
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "auto"}
    assert post_json(port, "/v1/chat/completions", json.dumps(body).encode())[0] == 503  # no scheduler behind it
    # as vLLM: auto (also the default with tools) needs --enable-auto-tool-choice
    for choice in ("auto", None):
        sent = {k: v for k, v in {**body, "tool_choice": choice}.items() if v is not None}
        status, reply = post_json(port_without_auto, "/v1/chat/completions", json.dumps(sent).encode())
        assert status == 400 and reply["error"]["param"] == "tool_choice", reply
        assert "--enable-auto-tool-choice" in reply["error"]["message"]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolSettings(tool_call_parser="mistral_v9")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolSettings(enable_auto_tool_choice=True)
    with pytest.raises(RequestError, match="tool_choice needs tools"):
        _plan({"tool_choice": "auto"})


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    plan, _ = _plan({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    two = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls, reason = whole_message(plan, two, "stop")
    assert content is None and reason == "tool_calls" and calls is not None
    assert [c.function.name for c in calls] == ["get_weather"]
    plan, _ = _plan({"tools": [WEATHER, TIME]})
    assert [c.function.name for c in whole_message(plan, two, "stop")[1] or []] == ["get_weather", "get_time"]
