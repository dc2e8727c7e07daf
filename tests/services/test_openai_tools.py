"""Tools through the three services with the unmodified `openai` client: `auto` (the cluster runs with
`--enable-auto-tool-choice --tool-call-parser hermes`), the history of calls and results, and `required` / a named
function enforced by the structured-output engine.
SmolLM2 does not write tool calls by itself: `auto` is checked against
the parser applied to the same greedy text, the round trip by what reaches the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from engine_core.io.tokenizer import Tokenizer
from services.frontend.tool_parsers.hermes import HermesToolParser
from services.launcher import LocalCluster

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# NOTE: additionalProperties false bounds the call (a schema that allows more properties lets the model go on past
# max_tokens, finishing `length`, which is the grammar working but not the round trip tested here).
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_auto_reads_the_models_text_streamed_and_not(oai: openai.OpenAI) -> None:
    # SmolLM2's template ignores tools: the prompt is the plain chat's, and so is the greedy text
    plain = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, temperature=0)
    text = plain.choices[0].message.content or ""
    content, calls = HermesToolParser().extract(text)
    full = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=16, temperature=0, tools=[WEATHER])
    message = full.choices[0].message
    assert message.content == content and not calls and not message.tool_calls
    assert full.choices[0].finish_reason == plain.choices[0].finish_reason
    stream = oai.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=16, temperature=0, tools=[WEATHER], tool_choice="auto", stream=True
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_history_of_calls_and_results_reaches_the_template(oai: openai.OpenAI, smollm2_tokenizer: Tokenizer) -> None:
    first = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, tools=[WEATHER])
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: Any = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
        first.choices[0].message,  # the SDK's own message object, sent back as the client library sends it
        {"role": "user", "content": "Thanks."},
    ]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, tools=[WEATHER])
    assert answer.choices[0].message.role == "assistant" and answer.usage is not None
    expected = [
        *USER,
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "18 degrees and sunny"},
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Thanks."},
    ]
    assert answer.usage.prompt_tokens == len(smollm2_tokenizer.apply_chat_template(expected))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_parse_and_round_trip(oai: openai.OpenAI, choice: str, stream: bool) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs: Any = {"model": MODEL, "messages": USER, "max_tokens": 128, "temperature": 0, "tools": [WEATHER]}
    if not stream:
        resp = oai.chat.completions.create(**kwargs, tool_choice=tool_choice)
        message, reason = resp.choices[0].message, resp.choices[0].finish_reason
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    else:
        chunks = [c for c in oai.chat.completions.create(**kwargs, tool_choice=tool_choice, stream=True) if c.choices]
        merged: dict[int, list[str]] = {}
        for c in chunks:
            for d in c.choices[0].delta.tool_calls or []:
                entry = merged.setdefault(d.index, ["", "", ""])
                entry[0] = d.id or entry[0]
                entry[1] = (d.function.name if d.function else None) or entry[1]
                entry[2] += (d.function.arguments if d.function else None) or ""
        calls = [tuple(merged[i]) for i in sorted(merged)]  # type: ignore[misc]
        reason = chunks[-1].choices[0].finish_reason
    assert calls and reason == ("tool_calls" if choice == "required" else "stop")
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name == "get_weather"
        jsonschema.validate(json.loads(arguments), PARAMETERS)
    sent = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]
    history: Any = [*USER, {"role": "assistant", "tool_calls": sent}]
    history.append({"role": "tool", "tool_call_id": calls[0][0], "content": "18 degrees"})
    final = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, tools=[WEATHER])
    assert final.choices[0].message.content is not None


def test_forced_call_streams_as_openai_deltas(oai: openai.OpenAI) -> None:
    """The SSE shape of tool calls: a named function's arguments arrive as deltas of call 0 (the first with its id,
    type and name), adding up to the non-streamed call, and no content."""
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: Any = {"model": MODEL, "messages": USER, "max_tokens": 12, "temperature": 0, "tools": [WEATHER]}
    full = oai.chat.completions.create(**kwargs, tool_choice=named)
    calls = full.choices[0].message.tool_calls or []
    assert len(calls) == 1 and full.choices[0].message.content is None
    assert full.choices[0].finish_reason in ("stop", "length")  # a named function never finishes with "tool_calls"
    chunks = [c for c in oai.chat.completions.create(**kwargs, tool_choice=named, stream=True) if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].id and deltas[0].type == "function" and deltas[0].function is not None
    assert deltas[0].function.name == "get_weather" and all(d.index == 0 and d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == calls[0].function.arguments
    assert all(not c.choices[0].delta.content for c in chunks)
