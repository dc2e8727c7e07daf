"""Output of requests whose tool call the grammar enforces (`tool_choice` required or a named function).

Named: the whole output is the function's arguments (the grammar is its parameters schema), streamed as argument
deltas of one call. Required: the output is a JSON array of `{"name", "parameters"}` (the schema built in
services/frontend/tool_calls.py, as vLLM's); the calls are sent whole when the array is complete. Output that does
not parse (no enforcement, or cut by max_tokens) is given back as content.
"""

from __future__ import annotations

import json

from services.frontend.tool_parsers.base import ParsedPiece, ToolCallDelta, ToolParser, call_from_json, new_call_id


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._id: str | None = None

    def feed(self, text: str) -> ParsedPiece:
        if not text:
            return ParsedPiece()
        if self._id is None:
            self._id = new_call_id()
            self.num_calls = 1
            return ParsedPiece(calls=[ToolCallDelta(0, text, self._id, self.name)])
        return ParsedPiece(calls=[ToolCallDelta(0, text)])

    def finish(self) -> ParsedPiece:
        return ParsedPiece()


class RequiredToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> ParsedPiece:
        self._buf += text
        return ParsedPiece()

    def finish(self) -> ParsedPiece:
        buf, self._buf = self._buf, ""
        try:
            items = json.loads(buf)
        except ValueError:
            return ParsedPiece(buf)
        calls = [call_from_json(item, ("parameters", "arguments")) for item in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return ParsedPiece(buf)
        return ParsedPiece(calls=[self.whole_call(*c) for c in calls if c is not None])
