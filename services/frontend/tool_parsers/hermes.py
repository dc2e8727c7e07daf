"""Hermes tool calls (Qwen2.5, Hermes 2/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
with free text around them. A block whose JSON is not a call is given back as content, tags included."""

from __future__ import annotations

import json

from services.frontend.tool_parsers.base import ParsedPiece, ToolParser, call_from_json, held_prefix

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._buf = ""
        self._inside = False
        self._space = ""  # whitespace after a call: dropped if only more calls (or the end) follow it

    def feed(self, text: str) -> ParsedPiece:
        self._buf += text
        out = ParsedPiece()
        while True:
            if self._inside:
                end = self._buf.find(END)
                if end < 0:
                    return out
                body, self._buf, self._inside = self._buf[:end], self._buf[end + len(END) :], False
                out += self._block(body, closed=True)
            else:
                start = self._buf.find(START)
                if start >= 0:
                    out += self._text(self._buf[:start], before_call=True)
                    self._buf, self._inside = self._buf[start + len(START) :], True
                    continue
                keep = held_prefix(self._buf, START)
                out += self._text(self._buf[: len(self._buf) - keep], before_call=False)
                self._buf = self._buf[len(self._buf) - keep :]
                return out

    def finish(self) -> ParsedPiece:
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            # NOTE: the model stopped (eos, max_tokens) before the closing tag: a complete call still counts.
            return self._block(buf, closed=False)
        return self._text(buf, before_call=True) if buf.strip() else ParsedPiece()

    def _text(self, text: str, before_call: bool) -> ParsedPiece:
        if self.num_calls == 0:
            return ParsedPiece(text)
        if not text.strip():
            if not before_call:
                self._space += text
            else:
                self._space = ""
            return ParsedPiece()
        text, self._space = self._space + text, ""
        return ParsedPiece(text)

    def _block(self, body: str, closed: bool) -> ParsedPiece:
        try:
            call = call_from_json(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            return self._text(START + body + (END if closed else ""), before_call=False)
        self._space = ""
        return ParsedPiece(calls=[self.whole_call(*call)])
