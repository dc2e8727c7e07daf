"""Size limits of one public request, checked before any tokenization, detokenizer set-up or scheduler message.

Every limit is a field of `ApiLimits` (its default written once, here) and a frontend flag of the same name
(`max_stop_strings` -> `--max-stop-strings`, env `PAGODA_MAX_STOP_STRINGS`). Wire ranges (int32/int64) are checked
here too, so an HTTP value that the Protobuf messages cannot carry is an INVALID_ARGUMENT naming the field, never a
500 from the serializer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from engine_core.sampling_params import SamplingParams
from services.common.flags import add_flag
from services.convert.ranges import check_ints, check_wire_ranges
from services.frontend.request import ChatMessage, GenerateInput, PromptInput, RequestError


def _limit(default: int, help: str) -> int:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ApiLimits:
    max_n: int = _limit(16, "choices per request (n)")
    max_stop_strings: int = _limit(16, "stop strings per request")
    max_stop_string_chars: int = _limit(256, "characters per stop string")
    max_stop_token_ids: int = _limit(256, "stop_token_ids per request")
    max_logit_bias: int = _limit(1024, "logit_bias entries per request")
    max_prompts: int = _limit(64, "prompts in one /v1/completions request")
    max_prompt_chars: int = _limit(262_144, "characters of a text prompt, or of all chat messages together")
    max_chat_messages: int = _limit(1024, "messages in one chat request")
    max_tools: int = _limit(128, "tools (function definitions) in one chat request")
    max_tools_chars: int = _limit(262_144, "characters of a chat request's tools, as JSON")
    max_request_id_chars: int = _limit(256, "characters of a client request_id (and of a cache_salt)")
    max_tracestate_chars: int = _limit(512, "characters of a W3C tracestate (longer ones are dropped, as W3C allows)")
    max_request_bytes: int = _limit(8 << 20, "bytes of one request: gRPC message or HTTP body")

    @staticmethod
    def add_flags(parser: argparse.ArgumentParser) -> None:
        for f in fields(ApiLimits):
            add_flag(parser, "--" + f.name.replace("_", "-"), default=f.default, type=int, help=f.metadata["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ApiLimits:
        limits = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
        bad = [f.name for f in fields(cls) if getattr(limits, f.name) < 1]
        if bad:
            raise ValueError(f"limits must be >= 1: {', '.join(bad)}")
        return limits

    # ---- checks -------------------------------------------------------------------------------------------------
    def check_request_id(self, request_id: str) -> None:
        if len(request_id) > self.max_request_id_chars or not request_id.isprintable():
            raise RequestError.invalid(
                f"request_id must be printable and at most {self.max_request_id_chars} characters", "request_id"
            )

    def check_prompt(self, prompt: PromptInput) -> None:
        if prompt.text is not None and len(prompt.text) > self.max_prompt_chars:
            raise RequestError.invalid(
                f"{prompt.field} is {len(prompt.text)} characters long; the limit is {self.max_prompt_chars}",
                prompt.field,
            )
        if prompt.messages is not None:
            if len(prompt.messages) > self.max_chat_messages:
                raise RequestError.invalid(
                    f"{prompt.field} has {len(prompt.messages)} messages; the limit is {self.max_chat_messages}",
                    prompt.field,
                )
            chars = sum(len(m.content) + len(m.role) + _calls_chars(m) for m in prompt.messages)
            if chars > self.max_prompt_chars:
                raise RequestError.invalid(
                    f"{prompt.field} is {chars} characters long; the limit is {self.max_prompt_chars}", prompt.field
                )
        if prompt.token_ids is not None:
            _wire(lambda: check_ints(prompt.field, prompt.token_ids or []), prompt.field)

    def check_params(self, params: SamplingParams) -> None:
        _check_count("n", params.n, self.max_n)
        if params.beam_width is not None:
            _check_count("beam_width", params.beam_width, self.max_n)
        stops = params.stop if isinstance(params.stop, list) else []
        _check_count("stop", len(stops), self.max_stop_strings, "strings")
        for s in stops:
            if len(s) > self.max_stop_string_chars:
                raise RequestError.invalid(
                    f"stop strings must be at most {self.max_stop_string_chars} characters, got {len(s)}", "stop"
                )
        _check_count("stop_token_ids", len(params.stop_token_ids or []), self.max_stop_token_ids, "ids")
        _check_count("logit_bias", len(params.logit_bias or {}), self.max_logit_bias, "entries")
        _wire(lambda: check_wire_ranges(params))

    def check_input(self, inp: GenerateInput) -> None:
        self.check_prompt(inp.prompt)
        self.check_params(inp.params)
        _wire(lambda: check_ints("priority", [inp.priority]), "priority")
        if inp.cache_salt is not None and len(inp.cache_salt) > self.max_request_id_chars:
            raise RequestError.invalid(
                f"cache_salt must be at most {self.max_request_id_chars} characters", "cache_salt"
            )

    def tracestate(self, value: str) -> str:
        return value if len(value) <= self.max_tracestate_chars else ""


def _calls_chars(m: ChatMessage) -> int:
    """Characters of a message's tool-call parts (earlier calls, the id a tool message answers, its name)."""
    calls = sum(len(c.id) + len(c.name) + len(json.dumps(c.arguments)) for c in m.tool_calls or ())
    return calls + len(m.tool_call_id or "") + len(m.name or "")


def _check_count(name: str, value: int, limit: int, unit: str = "") -> None:
    if value > limit:
        has = f"has {value} {unit}" if unit else f"is {value}"
        raise RequestError.invalid(f"{name} {has}; the limit is {limit}", name)


def _wire(check: Callable[[], None], field: str | None = None) -> None:
    try:
        check()
    except ValueError as e:
        raise RequestError.invalid(str(e), field) from e
