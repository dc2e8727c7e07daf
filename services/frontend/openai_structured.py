"""OpenAI's `response_format` and vLLM's `structured_outputs` request fields, and their StructuredOutputsParams.

Both endpoints take either (not both): `response_format` {"type": "text" | "json_object" | "json_schema",
"json_schema": {"name", "schema", "strict", "description"}} as OpenAI, and `structured_outputs` with exactly one of
json / regex / choice / grammar / json_object as vLLM. The constraint is compiled here (without a tokenizer, no
torch: engine_core/structured_output/grammar.py) so a bad one is a 400 naming the request's own field before any
engine work.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine_core.structured_output import grammar
from engine_core.structured_output.params import StructuredOutputsParams
from services.frontend.request import RequestError


class _Request(BaseModel):
    # NOTE: the request bodies' rules (openai_protocol._Request): unknown fields and coercions are errors, and text
    # must be valid Unicode (a lone surrogate escape is valid JSON; the grammar engine, in Rust, would refuse it).
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: object) -> object:
        if isinstance(value, str | list | dict):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"text must be valid Unicode (a lone surrogate at character {e.start})") from None
        return value


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=256)
    # NOTE: `schema` and `json` shadow BaseModel attributes: the Python names differ, the JSON names are OpenAI's.
    schema_: dict[str, object] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    json_: str | dict[str, object] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None


def structured_outputs(
    response_format: ResponseFormat | None, fields: StructuredOutputsRequest | None
) -> StructuredOutputsParams | None:
    """The request's constraint, compiled once to check it; RequestError naming the field."""
    fmt = response_format
    if fmt is not None and fmt.type != "text" and fields is not None:
        raise RequestError.invalid("response_format and structured_outputs are exclusive: set one", "response_format")
    try:
        if fields is not None:
            params = StructuredOutputsParams(
                json=fields.json_,
                regex=fields.regex,
                choice=fields.choice,
                grammar=fields.grammar,
                json_object=bool(fields.json_object),
                disable_any_whitespace=fields.disable_any_whitespace,
                whitespace_pattern=fields.whitespace_pattern,
            )
            grammar.check(params)
            return params
    except ValueError as e:
        raise RequestError.invalid(str(e)) from e
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    field = "response_format.json_schema.schema"
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError.invalid(f"{field} is required with type json_schema", field)
    try:
        params = StructuredOutputsParams(json=fmt.json_schema.schema_)
        grammar.check(params)
    except ValueError as e:
        message = str(e).replace("structured_outputs.json", field, 1)
        raise RequestError.invalid(message, field) from e
    return params
