"""Tool-call parsers of model output, chosen by `--tool-call-parser` (vLLM's names)."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ParsedPiece, ToolCall, ToolCallDelta, ToolParser, collect
from services.frontend.tool_parsers.hermes import HermesToolParser
from services.frontend.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "ParsedPiece", "ToolCall", "ToolCallDelta", "ToolParser", "collect"]
