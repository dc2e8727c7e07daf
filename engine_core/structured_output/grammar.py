"""A constraint as llguidance grammar text, and its validation without a tokenizer (no torch: the frontend runs it).

NOTE: llguidance bounds its own work with fuel, not wall time (`LIMITS`): the grammar's size, the lexer's states, the
lexer work of the first mask and of every later one. A hostile schema or regex therefore fails with a clear error in
bounded time instead of compiling for minutes (vLLM's issue #54003 has no such bound for JSON).
"""

from __future__ import annotations

import json

import llguidance

from engine_core.structured_output.params import ConstraintKind, StructuredOutputsParams

# llguidance's defaults, written down so the bound is ours: they keep one mask under ~a few ms on a schema-sized
# grammar and stop a pathological one with an error.
LIMITS = {
    "max_grammar_size": 500_000,
    "max_lexer_states": 250_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
}


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def field_name(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind.value}"


def to_grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (its JSON text). Raises ValueError naming the field."""
    kind = params.kind
    try:
        if kind in (ConstraintKind.JSON, ConstraintKind.JSON_OBJECT):
            schema = params.schema_text if kind is ConstraintKind.JSON else '{"type": "object"}'
            defaults: dict[str, object] = {"whitespace_flexible": not params.disable_any_whitespace}
            if params.whitespace_pattern is not None:
                defaults["whitespace_pattern"] = params.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
        if kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind is ConstraintKind.CHOICE:
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{field_name(params)} is invalid: {e}") from None


def check(params: StructuredOutputsParams) -> None:
    """Compiles the constraint without a tokenizer: a schema llguidance cannot enforce (an invalid type, an unknown
    format, a bad `pattern`), an invalid regex or a grammar that does not parse raises ValueError naming the field and
    the reason, before any engine work."""
    grammar = to_grammar(params)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if is_error:
        reason = "; ".join(str(m).strip() for m in messages)[:500]
        raise ValueError(f"{field_name(params)} is invalid: {reason}")
