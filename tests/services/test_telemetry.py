"""Span shapes of the services' tracing helpers (the SDK's in-memory exporter), the tracing configuration, and
the OTLP export path into the test receiver. No model, no services: fast."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from engine_core.core.request import Request
from engine_core.io.request_output import CompletionOutput, RequestOutput
from engine_core.plan import SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.step_timings import StepTimings
from services.common.telemetry import (
    SCHEDULER_SERVICE_NAME,
    Telemetry,
    TracingSettings,
    create_exporter,
    resolve_endpoint,
)
from services.common.trace import TraceContext, span_context_of
from services.frontend.tracing import RequestSpan, operation_name, request_attributes
from services.rpc import worker_pb2
from services.scheduler.tracing import StepTracer, record_request
from services.worker.tracing import record_execute
from tests.scheduler_sim import Harness, make_request, make_scheduler
from tests.services.otlp_receiver import OtlpReceiver

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def memory() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Telemetry(provider).tracer, exporter
    provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


# ---- configuration ------------------------------------------------------------------------------------------------
def test_no_endpoint_means_no_tracing(clean_env: pytest.MonkeyPatch) -> None:
    assert resolve_endpoint(TracingSettings(SCHEDULER_SERVICE_NAME)) is None


def test_endpoint_from_flag_or_standard_variables(clean_env: pytest.MonkeyPatch) -> None:
    settings = TracingSettings(SCHEDULER_SERVICE_NAME)
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert resolve_endpoint(settings) == "http://collector:4317"
    clean_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert resolve_endpoint(settings) == "http://traces:4317"
    assert resolve_endpoint(TracingSettings(SCHEDULER_SERVICE_NAME, "http://flag:4317")) == "http://flag:4317"
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    assert resolve_endpoint(TracingSettings(SCHEDULER_SERVICE_NAME, "http://flag:4317")) is None


def test_protocol_picks_the_exporter(clean_env: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    settings = TracingSettings(SCHEDULER_SERVICE_NAME, "http://127.0.0.1:4318")
    assert isinstance(create_exporter(settings), GrpcExporter)
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    exporter = create_exporter(settings)
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        create_exporter(settings)


def test_trace_context_round_trip(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, _ = memory
    span = tracer.start_span("x")
    tc = TraceContext.of_span(span)
    ctx = span_context_of(tc)
    assert ctx is not None and ctx.trace_id == span.get_span_context().trace_id
    assert ctx.span_id == span.get_span_context().span_id and ctx.trace_flags.sampled
    assert tc.trace_id == f"{ctx.trace_id:032x}" and tc.span_id == f"{ctx.span_id:016x}"
    span.end()


# ---- frontend -----------------------------------------------------------------------------------------------------
def test_frontend_request_span_shape(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, seed=3)
    attrs = request_attributes(operation_name(True), "SmolLM2-135M-Instruct", params, stream=True)
    with tracer.start_as_current_span("server") as server:
        rs = RequestSpan(tracer, "chat SmolLM2-135M-Instruct", attrs)
    rs.tokenize_span().end()
    t0 = rs.detokenize_begin()
    rs.detokenize_end(t0)
    rs.detokenize_end(rs.detokenize_begin())
    outputs = [
        CompletionOutput(0, token_ids=[1, 2, 3], finish_reason="stop"),
        CompletionOutput(1, token_ids=[4], finish_reason="length"),
    ]
    rs.finish("req-1", RequestOutput("req-1", None, [5] * 11, outputs, True, num_cached_tokens=8), 11)
    spans = by_name(exporter.get_finished_spans())
    main = spans["chat SmolLM2-135M-Instruct"]
    assert main.parent is not None and main.parent.span_id == server.get_span_context().span_id
    a = main.attributes
    assert a is not None
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "pagoda"
    assert a["gen_ai.request.model"] == "SmolLM2-135M-Instruct"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (7, 0.5, 0.9)
    assert (a["gen_ai.request.top_k"], a["gen_ai.request.seed"], a["gen_ai.request.choice.count"]) == (20, 3, 2)
    assert a["gen_ai.request.stream"] is True
    assert a["gen_ai.response.id"] == "req-1" and tuple(a["gen_ai.response.finish_reasons"]) == ("stop", "length")
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (11, 4)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 8
    assert "error.type" not in a
    for child in ("tokenize", "detokenize"):
        assert spans[child].parent is not None and spans[child].parent.span_id == main.context.span_id
    assert spans["detokenize"].attributes["pagoda.detokenize.calls"] == 2


def test_frontend_request_span_error(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    rs = RequestSpan(tracer, "text_completion m", {})
    rs.finish("req-2", None, 3, error_type="INVALID_ARGUMENT", message="bad")
    (span,) = exporter.get_finished_spans()
    assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert span.status.status_code == trace.StatusCode.ERROR
    assert [s.name for s in exporter.get_finished_spans()] == ["text_completion m"]  # no detokenize: no output


# ---- scheduler ----------------------------------------------------------------------------------------------------
def test_scheduler_request_phases_events_and_latency(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    h = Harness(make_scheduler(num_blocks=6, max_model_len=24))
    h.add(make_request(list(range(10, 18)), max_tokens=12))
    request = h.add(make_request(list(range(20, 28)), max_tokens=12))
    h.run()
    submit = tracer.start_span("/pagoda.v1.Scheduler/Submit", kind=SpanKind.SERVER)
    record_request(tracer, submit, request)
    submit.end()
    spans = by_name(exporter.get_finished_spans())
    s = spans["/pagoda.v1.Scheduler/Submit"]
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].parent is not None and spans[phase].parent.span_id == s.context.span_id
    assert spans["queue"].end_time <= spans["prefill"].start_time + 1000
    assert spans["prefill"].end_time <= spans["decode"].start_time + 1000
    names = [e.name for e in s.events]
    assert names and names[0] == "preempted" and names.count("preempted") == names.count("resumed")
    a = s.attributes
    assert a["pagoda.request.num_preemptions"] == names.count("preempted")
    assert a["pagoda.request.num_steps"] == request.timings.num_steps > 0
    assert a["gen_ai.usage.completion_tokens"] == 12
    for key in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode"):
        assert a[f"gen_ai.latency.{key}"] >= 0
    assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]


def _traced_request(
    tracer: trace.Tracer, rid: str, sampled: bool = True, max_tokens: int = 3
) -> tuple[Request, trace.Span]:
    req = make_request([5, 6, 7, 8], request_id=rid, max_tokens=max_tokens)
    span = tracer.start_span(f"submit {rid}")
    tc = TraceContext.of_span(span)
    if not sampled:
        tc = TraceContext(tc.traceparent[:-2] + "00")
    req.trace_context = tc.as_dict()
    span.end()
    return req, span


def test_step_span_links_requests_and_parents_on_the_first(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    h = Harness(make_scheduler())
    a, span_a = _traced_request(tracer, "a")
    b, span_b = _traced_request(tracer, "b")
    c, _ = _traced_request(tracer, "c", sampled=False)
    for r in (a, b, c):
        h.add(r)
    steps = StepTracer(tracer, max_per_second=1000)
    span = steps.start(h.step(), 0)
    assert span is not None
    span.end()
    (step,) = [s for s in exporter.get_finished_spans() if s.name == "step"]
    linked = {link.context.span_id for link in step.links}
    assert linked == {span_a.get_span_context().span_id, span_b.get_span_context().span_id}  # c is not sampled
    assert step.parent is not None and step.parent.span_id == span_a.get_span_context().span_id
    assert step.context.trace_id == span_a.get_span_context().trace_id
    assert step.attributes["pagoda.step.batch_size"] == 3
    assert step.attributes["pagoda.step.num_scheduled_tokens"] == 12
    assert step.attributes["pagoda.step.num_prefill_seqs"] == 3
    # later steps: the sequences are known from their first step (decode steps carry no context)
    span = steps.start(h.step(), 1)
    assert span is not None
    span.end()
    assert {link.context.span_id for link in exporter.get_finished_spans()[-1].links} == linked


def test_step_span_counts_verification_rows_as_decodes(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    h = Harness(make_scheduler())
    h.add(_traced_request(tracer, "a")[0])
    steps = StepTracer(tracer, max_per_second=1000)
    first = h.step()
    steps.start(first, 0).end()  # type: ignore[union-attr]
    (seq_id,) = first.num_scheduled_tokens
    # A decode row verifying 3 drafts (speculative decoding): 4 query tokens, none of them prefill.
    plan = SchedulerOutput(num_scheduled_tokens={seq_id: 4}, scheduled_spec_decode_tokens={seq_id: [1, 2, 3]})
    plan.total_num_scheduled_tokens = 4
    steps.start(plan, 1).end()  # type: ignore[union-attr]
    a = exporter.get_finished_spans()[-1].attributes
    assert (a["pagoda.step.num_decode_seqs"], a["pagoda.step.num_prefill_tokens"]) == (1, 0)
    assert a["pagoda.step.num_draft_tokens"] == 3


def test_step_spans_only_for_sampled_requests_and_rate_capped(
    memory: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = memory
    h = Harness(make_scheduler())
    h.add(_traced_request(tracer, "u", sampled=False)[0])
    steps = StepTracer(tracer, max_per_second=2)
    assert steps.start(h.step(), 0) is None
    h.add(_traced_request(tracer, "s", max_tokens=20)[0])
    started = [steps.start(h.step(), i) for i in range(1, 6)]
    assert sum(s is not None for s in started) == 2  # a burst of one second's worth, then nothing
    time.sleep(0.6)
    assert steps.start(h.step(), 6) is not None  # refilled at 2 per second


# ---- worker -------------------------------------------------------------------------------------------------------
def test_worker_execute_span_is_the_steps_child(memory: tuple[trace.Tracer, InMemorySpanExporter]) -> None:
    tracer, exporter = memory
    step = tracer.start_span("step")
    msg = worker_pb2.ExecuteRequest(step=4, scheduled_seq_ids=[1, 2], num_scheduled_tokens=[5, 1])
    msg.trace.CopyFrom(TraceContext.of_span(step).to_proto())
    now = time.perf_counter()
    timings = StepTimings(start=now - 0.004, forward_start=now - 0.003, sample_start=now - 0.001, end=now)
    record_execute(tracer, msg, timings, rank=0, end=now)
    record_execute(tracer, worker_pb2.ExecuteRequest(step=5), timings, rank=0, end=now)  # untraced: nothing
    step.end()
    spans = by_name(exporter.get_finished_spans())
    ex = spans["Execute"]
    assert ex.kind is SpanKind.SERVER and ex.parent is not None
    assert ex.parent.span_id == step.get_span_context().span_id
    assert ex.attributes["pagoda.step.index"] == 4 and ex.attributes["pagoda.step.num_scheduled_tokens"] == 6
    for name in ("prepare_inputs", "forward", "sample"):
        assert spans[name].parent is not None and spans[name].parent.span_id == ex.context.span_id
    assert spans["prepare_inputs"].end_time <= spans["forward"].start_time + 1000
    assert len([s for s in exporter.get_finished_spans() if s.name == "Execute"]) == 1


# ---- export -------------------------------------------------------------------------------------------------------
def test_spans_reach_an_otlp_grpc_receiver(clean_env: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    with OtlpReceiver() as receiver:
        provider = TracerProvider(resource=Resource.create({"service.name": SCHEDULER_SERVICE_NAME}))
        provider.add_span_processor(BatchSpanProcessor(create_exporter(TracingSettings("x", receiver.endpoint))))
        telemetry = Telemetry(provider)
        with telemetry.tracer.start_as_current_span("parent"):
            telemetry.tracer.start_span("child").end()
        telemetry.shutdown()  # flushes: what a service does at the end of its SIGTERM drain
        spans = receiver.wait_for(lambda s: len(s) == 2, timeout=10)
    parent = next(s for s in spans if s.name == "parent")
    child = next(s for s in spans if s.name == "child")
    assert child.parent_span_id == parent.span_id and child.trace_id == parent.trace_id
    assert parent.service == SCHEDULER_SERVICE_NAME
