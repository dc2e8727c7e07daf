"""Structured output over the APIs: OpenAI's response_format (json_object, json_schema, the SDK's parse() with a
Pydantic model) and vLLM's structured_outputs through the three services with the `openai` client, the gRPC
SamplingOptions.structured_outputs oneof, and bad or hostile constraints refused with 400 / INVALID_ARGUMENT naming
the field before any engine work, the server serving on and its blocks back to idle."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import jsonschema
import openai
import pydantic
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from engine_core import SamplingParams, StructuredOutputsParams
from engine_core.io.tokenizer import Tokenizer
from engine_core.step_timings import StepTimings
from engine_core.structured_output.backend import GrammarCompile
from engine_core.structured_output.guidance import backend_for_model
from services.client import GenerationClient
from services.convert.params import params_from_proto, params_to_proto
from services.frontend.http_guard import HttpConnectionLimits
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2, scheduler_pb2_grpc, worker_pb2
from services.worker.metrics import WorkerMetrics
from services.worker.tracing import record_execute
from tests.services.conftest import stats
from tests.services.http_frontend import http_frontend, post_json

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct"
USER = b'"messages": [{"role": "user", "content": "hi"}]'


SCHEMA_PARAM = "response_format.json_schema.schema"


def so(fields: bytes) -> bytes:
    return b'{"prompt": "hi", "structured_outputs": ' + fields + b"}"


def chat(extra: bytes) -> bytes:
    return b"{" + USER + b", " + extra + b"}"


def schema_format(schema: bytes) -> bytes:
    return b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + b"}}"


BAD: list[tuple[str, str, bytes, str]] = [
    ("invalid schema type", CHAT, chat(schema_format(b'{"type": "objectx"}')), SCHEMA_PARAM),
    ("unknown format", CHAT, chat(schema_format(b'{"type": "string", "format": "nope"}')), SCHEMA_PARAM),
    ("bad pattern", CHAT, chat(schema_format(b'{"type": "string", "pattern": "(("}')), SCHEMA_PARAM),
    ("no schema", CHAT, chat(b'"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}'),
     SCHEMA_PARAM),
    ("unknown response_format type", CHAT, chat(b'"response_format": {"type": "xml"}'), "response_format.type"),
    ("invalid regex", CMPL, so(b'{"regex": "((("}'), "structured_outputs.regex"),
    ("grammar that does not parse", CMPL, so(b'{"grammar": "start: nope"}'), "structured_outputs.grammar"),
    ("two constraints", CMPL, so(b'{"regex": "a", "choice": ["a"]}'), "structured_outputs"),
    ("no constraint", CMPL, so(b'{}'), "structured_outputs"),
    ("empty choice", CMPL, so(b'{"choice": []}'), "structured_outputs.choice"),
    ("unknown field", CMPL, so(b'{"jsn": "{}"}'), "structured_outputs.jsn"),
    ("schema text not JSON", CMPL, so(b'{"json": "{nope"}'), "structured_outputs.json"),
    ("huge regex", CMPL, so(b'{"regex": "' + b"a" * 20000 + b'"}'), "structured_outputs.regex"),
    ("deep schema", CMPL, so(b'{"json": ' + b'{"items": ' * 40 + b"{}" + b"}" * 41), "structured_outputs.json"),
    ("lone surrogate in a schema", CHAT, chat(schema_format(b'{"enum": ["\\ud800"]}')), "response_format"),
    ("lone surrogate in a regex", CMPL, so(b'{"regex": "\\udfff"}'), "structured_outputs"),
    ("both fields", CHAT, chat(b'"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}'),
     "response_format"),
]  # fmt: skip


@pytest.fixture(scope="module")
def port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(30.0, 30.0, 0, 0)) as p:
        yield p


@pytest.mark.parametrize(("case", "path", "body", "param"), BAD, ids=[c[0] for c in BAD])
def test_bad_constraint_is_400_naming_the_field(port: int, case: str, path: str, body: bytes, param: str) -> None:
    status, answer = post_json(port, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_valid_constraints_pass_validation(port: int) -> None:
    """Each kind passes the frontend's checks and reaches the scheduler (not running here: 503)."""
    for extra in (
        b'"response_format": {"type": "json_object"}',
        b'"response_format": {"type": "text"}',
        schema_format(b'{"type": "object", "properties": {"a": {"type": "integer"}}}'),
        b'"structured_outputs": {"choice": ["a", "b"]}',
        b'"structured_outputs": {"json": "{\\"type\\": \\"object\\"}", "disable_any_whitespace": true}',
        b'"structured_outputs": {"grammar": "root ::= \\"a\\" | \\"b\\""}',
    ):
        status, answer = post_json(port, CHAT, chat(extra))
        assert status == 503, (extra, answer)


# ---- through the three services -----------------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


@pytest.fixture(scope="module")
def oai(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.slow
def test_openai_json_schema_regex_choice_through_the_services(
    oai: openai.OpenAI, cluster: LocalCluster, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        n=3,
        temperature=0.8,
        seed=7,
        max_tokens=200,
        extra_body={"structured_outputs": None},
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    parsed = oai.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "A city and its country, as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=200,
    )
    assert isinstance(parsed.choices[0].message.parsed, City)
    anyobj = oai.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=300,
    )
    if anyobj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anyobj.choices[0].message.content or ""), dict)
    # vLLM's extension field, on completions, streamed
    chunks = oai.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=20,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    choice = oai.completions.create(
        model=MODEL,
        prompt="Is the sky blue?",
        max_tokens=10,
        temperature=1.0,
        n=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert all(c.text in ("yes", "no") for c in choice.choices)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"json": {"type": "nope"}}}
        )
    assert bad.value.body["param"] == "structured_outputs.json"  # type: ignore[index]
    s = stats(scheduler_stats)
    assert s.free_blocks == s.total_blocks and s.running == 0 and s.waiting == 0
    with urllib.request.urlopen(f"{cluster.http_url}/metrics", timeout=30) as answer:
        scrape = answer.read().decode()
    assert re.search(r'pagoda:structured_output_requests_total\{kind="json",model_name="[^"]+"\} [1-9]', scrape)
    assert re.search(r'pagoda:structured_output_requests_total\{kind="choice",model_name="[^"]+"\} [1-9]', scrape)


@pytest.mark.slow
def test_grpc_generate_takes_the_oneof(client: GenerationClient) -> None:
    so = common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=["alpha", "beta"]))
    opts = common_pb2.SamplingOptions(max_tokens=8, temperature=1.0, n=2, structured_outputs=so)
    result = client.generate(generation_pb2.GenerateRequest(text="Pick one:", sampling=opts))
    assert all(c.text in ("alpha", "beta") for c in result.choices), result
    bad = common_pb2.SamplingOptions(max_tokens=4, structured_outputs=common_pb2.StructuredOutputs(regex="((("))
    with pytest.raises(grpc.RpcError) as info:
        client.generate(generation_pb2.GenerateRequest(text="x", sampling=bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("structured_outputs.regex")  # type: ignore[union-attr]


# ---- metrics and the compile span event ----------------------------------------------------------------------------
def test_worker_metrics_and_span_event_for_compiles(smollm2_dir: str) -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "m")
    compiles: list[GrammarCompile] = []
    backend = backend_for_model(smollm2_dir, 49152, 2)
    assert backend is not None
    backend.on_compile = compiles.append
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    backend.matcher(so)
    backend.matcher(so)  # the compiled grammar is cached by key
    backend.matcher(StructuredOutputsParams(choice=["x", "y"]))
    assert [(c.kind, c.cache_hit) for c in compiles] == [("json", False), ("json", True), ("choice", False)]
    for event in compiles:
        metrics.observe_grammar(event)
    sample = registry.get_sample_value
    assert sample("pagoda:structured_output_matchers_total", {"model_name": "m", "kind": "json", "cache": "hit"}) == 1
    assert sample("pagoda:structured_output_matchers_total", {"model_name": "m", "kind": "json", "cache": "miss"}) == 1
    assert sample("pagoda:structured_output_compile_seconds_count", {"model_name": "m"}) == 3

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    request = worker_pb2.ExecuteRequest(step=3)
    request.trace.traceparent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    now = time.perf_counter()
    timings = StepTimings(start=now - 0.01, forward_start=now - 0.008, sample_start=now - 0.002, end=now)
    record_execute(provider.get_tracer("t"), request, timings, 0, now, compiles)
    (execute,) = [s for s in exporter.get_finished_spans() if s.name == "Execute"]
    events = [e for e in execute.events if e.name == "structured_output.compile"]
    assert [e.attributes["pagoda.structured_output.kind"] for e in events] == ["json", "json", "choice"]  # type: ignore[index]


def test_sampling_options_round_trip_every_kind() -> None:
    for so in (
        StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True),
        StructuredOutputsParams(json='{"type": "array"}', whitespace_pattern="[ ]?"),
        StructuredOutputsParams(regex="[a-z]+"),
        StructuredOutputsParams(choice=["a", "b c"]),
        StructuredOutputsParams(grammar='start: "x"'),
        StructuredOutputsParams(json_object=True),
    ):
        back = params_from_proto(params_to_proto(SamplingParams(structured_outputs=so)), internal=True)
        assert back.structured_outputs is not None
        assert back.structured_outputs.key == so.key
    with pytest.raises(ValueError, match=r"^structured_outputs must set exactly one"):
        params_from_proto(common_pb2.SamplingOptions(structured_outputs=common_pb2.StructuredOutputs()))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json_object must be true"):
        params_from_proto(
            common_pb2.SamplingOptions(structured_outputs=common_pb2.StructuredOutputs(json_object=False))
        )
