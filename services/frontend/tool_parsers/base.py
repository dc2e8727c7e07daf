"""What every tool-call parser gives back: content text and tool-call deltas, as OpenAI streams them.

A parser reads one choice's text as it streams (`feed`, then `finish` once); what it returns for any split of the
text into chunks adds up to the same content and calls (tests/services/test_tool_parsers.py checks this for
arbitrary chunkings). Text that might still turn into a tool call is held back, never sent as content.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call `index`: the first carries its id and name, every one a part of the arguments
    (a parser that only emits whole calls sends all of them at once)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass
class ParsedPiece:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: ParsedPiece) -> ParsedPiece:
        return ParsedPiece(self.content + other.content, self.calls + other.calls)


def collect(pieces: list[ParsedPiece]) -> tuple[str, list[ToolCall]]:
    """The whole message: the content and every tool call with its arguments put together."""
    content = "".join(p.content for p in pieces)
    calls: dict[int, ToolCall] = {}
    for p in pieces:
        for d in p.calls:
            if d.index not in calls:
                calls[d.index] = ToolCall(d.id or new_call_id(), d.name or "", "")
            calls[d.index].arguments += d.arguments
    return content, [calls[i] for i in sorted(calls)]


class ToolParser(ABC):
    """Parses one choice's streamed text; a new instance per choice."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abstractmethod
    def feed(self, text: str) -> ParsedPiece: ...

    @abstractmethod
    def finish(self) -> ParsedPiece: ...

    def whole_call(self, name: str, arguments: str) -> ToolCallDelta:
        delta = ToolCallDelta(self.num_calls, arguments, new_call_id(), name)
        self.num_calls += 1
        return delta

    def extract(self, text: str) -> tuple[str, list[ToolCall]]:
        return collect([self.feed(text), self.finish()])


def call_from_json(obj: object, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of `{"name": ..., <arguments key>: {...}}`, or None when `obj` is not such a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return obj["name"], "{}"


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
