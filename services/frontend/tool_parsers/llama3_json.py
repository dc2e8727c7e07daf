"""Llama 3.x JSON tool calls: the whole message is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, and several separated by `;`). A message that starts otherwise is content from its first
character; one that starts like a call but does not parse as calls is given back whole as content."""

from __future__ import annotations

import json

from services.frontend.tool_parsers.base import ParsedPiece, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # None: undecided; "calls": held to the end; "text": content

    def feed(self, text: str) -> ParsedPiece:
        if self._mode == "text":
            return ParsedPiece(text)
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = "calls"
            elif head and not PYTHON_TAG.startswith(head):
                self._mode = "text"
                buf, self._buf = self._buf, ""
                return ParsedPiece(buf)
        return ParsedPiece()

    def finish(self) -> ParsedPiece:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return ParsedPiece(buf)
        calls = _parse_calls(buf.lstrip().removeprefix(PYTHON_TAG))
        if calls is None:
            return ParsedPiece(buf)
        return ParsedPiece(calls=[self.whole_call(*c) for c in calls])


def _parse_calls(text: str) -> list[tuple[str, str]] | None:
    decoder = json.JSONDecoder()
    calls: list[tuple[str, str]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        call = call_from_json(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        pos = len(text) - len(rest)
    return calls or None
