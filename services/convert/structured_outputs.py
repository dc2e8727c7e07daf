"""StructuredOutputsParams <-> StructuredOutputs (the oneof of common.proto)."""

from __future__ import annotations

from engine_core.structured_output.params import ConstraintKind, StructuredOutputsParams
from services.rpc import common_pb2


def structured_outputs_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Builds (and so validates) the params; ValueError naming the field (`structured_outputs...`)."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object")
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_outputs.json_object must be true when set")
    value: object = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    pattern = msg.whitespace_pattern if msg.HasField("whitespace_pattern") else None
    return StructuredOutputsParams(
        **{kind: value},  # type: ignore[arg-type]
        disable_any_whitespace=msg.disable_any_whitespace,
        whitespace_pattern=pattern,
    )


def structured_outputs_to_proto(params: StructuredOutputsParams, out: common_pb2.StructuredOutputs) -> None:
    kind = params.kind
    if kind is ConstraintKind.JSON:
        out.json = params.schema_text or ""
    elif kind is ConstraintKind.REGEX:
        out.regex = params.regex or ""
    elif kind is ConstraintKind.CHOICE:
        out.choice.choices.extend(params.choice or [])
    elif kind is ConstraintKind.GRAMMAR:
        out.grammar = params.grammar or ""
    else:
        out.json_object = True
    out.disable_any_whitespace = params.disable_any_whitespace
    if params.whitespace_pattern is not None:
        out.whitespace_pattern = params.whitespace_pattern
