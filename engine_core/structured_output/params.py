"""StructuredOutputsParams: the output constraint of a request, vLLM's name and fields, validated on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

# Hostile-input bounds, checked before any parsing or compiling (every entry point shares them).
MAX_SCHEMA_CHARS = 64 * 1024  # the JSON schema as JSON text
MAX_SCHEMA_DEPTH = 32  # nesting of objects/arrays in the schema document
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 64 * 1024  # all choices together
MAX_WHITESPACE_PATTERN_CHARS = 256


class ConstraintKind(StrEnum):
    JSON = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"


def _depth(value: object, limit: int) -> int:
    """Nesting depth of a JSON document, iteratively (a hostile schema must not exhaust the Python stack)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or JSON text), `regex`, `choice`, `grammar` (Lark or GBNF,
    as vLLM's guidance backend takes it) or `json_object` (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> ConstraintKind:
        if self.json is not None:
            return ConstraintKind.JSON
        if self.regex is not None:
            return ConstraintKind.REGEX
        if self.choice is not None:
            return ConstraintKind.CHOICE
        if self.grammar is not None:
            return ConstraintKind.GRAMMAR
        return ConstraintKind.JSON_OBJECT

    @property
    def schema_text(self) -> str | None:
        """The JSON schema as JSON text (what crosses a process boundary); None for the other kinds."""
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else json.dumps(self.json)

    @property
    def key(self) -> tuple[str, str, bool, str | None]:
        """What identifies the compiled grammar (the cache key)."""
        spec = {
            ConstraintKind.JSON: lambda: self.schema_text or "",
            ConstraintKind.REGEX: lambda: self.regex or "",
            ConstraintKind.CHOICE: lambda: json.dumps(self.choice),
            ConstraintKind.GRAMMAR: lambda: self.grammar or "",
            ConstraintKind.JSON_OBJECT: lambda: "",
        }[self.kind]()
        return (self.kind.value, spec, self.disable_any_whitespace, self.whitespace_pattern)

    def validate(self) -> None:
        """Shape and size checks (cheap, no compiling); ValueError naming the field."""
        name = "structured_outputs"
        set_kinds = [
            k
            for k, v in (("json", self.json), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
            if v is not None
        ]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"{name}.json_object must be a boolean, got {self.json_object!r}")
        if self.json_object:
            set_kinds.append("json_object")
        if len(set_kinds) != 1:
            raise ValueError(
                f"{name} must set exactly one of json, regex, choice, grammar, json_object; got {set_kinds or 'none'}"
            )
        if self.json is not None:
            self._validate_schema()
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"{name}.regex must be a non-empty string")
            if len(self.regex) > MAX_REGEX_CHARS:
                raise ValueError(f"{name}.regex has {len(self.regex)} characters; at most {MAX_REGEX_CHARS}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"{name}.choice must be a non-empty list of non-empty strings")
            if len(choice) > MAX_CHOICES or sum(map(len, choice)) > MAX_CHOICE_CHARS:
                raise ValueError(
                    f"{name}.choice must hold at most {MAX_CHOICES} strings of {MAX_CHOICE_CHARS} characters in all"
                )
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"{name}.grammar must be a non-empty string")
            if len(self.grammar) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"{name}.grammar has {len(self.grammar)} characters; at most {MAX_GRAMMAR_CHARS}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{name}.disable_any_whitespace must be a boolean")
        pattern = self.whitespace_pattern
        if pattern is not None and (not isinstance(pattern, str) or len(pattern) > MAX_WHITESPACE_PATTERN_CHARS):
            raise ValueError(f"{name}.whitespace_pattern must be a string of at most {MAX_WHITESPACE_PATTERN_CHARS}")

    def _validate_schema(self) -> None:
        name = "structured_outputs.json"
        schema = self.json
        if isinstance(schema, str):
            if len(schema) > MAX_SCHEMA_CHARS:
                raise ValueError(f"{name} has {len(schema)} characters; at most {MAX_SCHEMA_CHARS}")
            try:
                parsed = json.loads(schema)
            except ValueError:
                raise ValueError(f"{name} is not valid JSON") from None
            except RecursionError:  # NOTE: json.loads recurses; Python's limit is far above MAX_SCHEMA_DEPTH
                raise ValueError(f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        elif isinstance(schema, dict):
            parsed = schema
        else:
            raise ValueError(f"{name} must be a JSON schema (an object or its JSON text), got {type(schema).__name__}")
        if not isinstance(parsed, dict | bool):
            raise ValueError(f"{name} must be a JSON object (a JSON schema), got {type(parsed).__name__}")
        if _depth(parsed, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(schema, dict):
            try:
                text = json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} is not a JSON document: {e}") from None
            if len(text) > MAX_SCHEMA_CHARS:
                raise ValueError(f"{name} has {len(text)} characters as JSON; at most {MAX_SCHEMA_CHARS}")
