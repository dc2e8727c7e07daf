"""Tool-call parsers on real model text: whole and streamed in arbitrary chunkings (the same content and calls
either way, and no piece of a call ever sent as content)."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.tool_parsers import TOOL_PARSERS, ParsedPiece, ToolParser, collect
from services.frontend.tool_parsers.forced import NamedToolParser, RequiredToolParser
from services.frontend.tool_parsers.hermes import HermesToolParser
from services.frontend.tool_parsers.llama3_json import Llama3JsonToolParser

# What Qwen2.5-Instruct writes for two parallel calls (its chat template's format), with text before them.
QWEN_TWO_CALLS = (
    "Let me check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TWO = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'


def test_hermes_finds_calls_and_keeps_text() -> None:
    content, calls = HermesToolParser().extract(QWEN_TWO_CALLS)
    assert content == "Let me check both cities.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_weather", {"city": "Tōkyō"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_hermes_plain_text_and_broken_blocks_are_content() -> None:
    assert HermesToolParser().extract("The answer is 4 < 5.") == ("The answer is 4 < 5.", [])
    broken = "<tool_call>{not json}</tool_call> sorry"
    assert HermesToolParser().extract(broken) == (broken, [])
    # a call without its closing tag (the model stopped at eos) still counts; a cut one is content
    content, calls = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}')
    assert content == "" and [c.name for c in calls] == ["f"]
    cut = '<tool_call>{"name": "f", "argu'
    assert HermesToolParser().extract(cut) == (cut, [])


def test_llama3_json() -> None:
    content, calls = Llama3JsonToolParser().extract(LLAMA_CALL)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    content, calls = Llama3JsonToolParser().extract(LLAMA_TWO)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert Llama3JsonToolParser().extract("Paris is sunny.") == ("Paris is sunny.", [])
    assert Llama3JsonToolParser().extract('{"no": "name"}') == ('{"no": "name"}', [])


def test_forced_parsers() -> None:
    content, calls = NamedToolParser("f").extract('{"x": 1}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    content, calls = RequiredToolParser().extract(
        '[{"name": "a", "parameters": {"q": "z"}}, {"name": "b", "parameters": {}}]'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"q": "z"}), ("b", {})]
    assert RequiredToolParser().extract("[]") == ("[]", [])  # no enforcement: what the model wrote is content


def _streamed(parser: ToolParser, text: str, cuts: list[int]) -> list[ParsedPiece]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    return [*pieces, parser.finish()]


TEXTS = [QWEN_TWO_CALLS, "plain < text <tool", "<tool_call>{bad}</tool_call>\n", LLAMA_CALL, LLAMA_TWO, "  hi"]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(TOOL_PARSERS)),
    st.sampled_from(TEXTS),
    st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_any_chunking_gives_the_whole_texts_result(name: str, text: str, cuts: list[int]) -> None:
    whole = TOOL_PARSERS[name]().extract(text)
    pieces = _streamed(TOOL_PARSERS[name](), text, cuts)
    content, calls = collect(pieces)
    assert content == whole[0]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]]
    if calls:  # no piece of a call's text reached the content
        assert "<tool_call>" not in content and '"name"' not in content
    # each call's first delta carries its id and name, once
    firsts = [d for p in pieces for d in p.calls if d.id is not None]
    assert [d.index for d in firsts] == list(range(len(calls)))
