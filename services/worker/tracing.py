"""The worker's `Execute` span: the child of the scheduler's step span, whose context travels in the step message.

Only steps the scheduler traced carry a context (detailed traces, a sampled request, under the rate cap), so the
worker has no tracing interceptor: an untraced step costs one empty-string check. The children (input
preparation, forward pass, sampling) come from the model runner's `StepTimings`.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from engine_core.step_timings import StepTimings
from engine_core.structured_output.backend import GrammarCompile
from services.common.timeutil import perf_counter_to_ns
from services.common.trace import TraceContext, span_context_of
from services.rpc import worker_pb2


def record_execute(
    tracer: trace.Tracer,
    request: worker_pb2.ExecuteRequest,
    timings: StepTimings,
    rank: int,
    end: float,
    compiles: list[GrammarCompile] | None = None,
) -> None:
    """Exports the span of a finished step (`end` is its time.perf_counter() when the response was ready), with an
    event per grammar matcher the step made (`structured_output.compile`)."""
    parent = span_context_of(TraceContext.from_proto(request.trace))
    if parent is None:
        return
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
    attrs = {
        "pagoda.step.index": request.step,
        "pagoda.worker.rank": rank,
        "pagoda.step.batch_size": len(request.scheduled_seq_ids),
        "pagoda.step.num_scheduled_tokens": sum(request.num_scheduled_tokens),
        "pagoda.step.num_new_seqs": len(request.new_seqs),
    }
    if timings.collective_s:
        attrs["pagoda.step.collective_s"] = timings.collective_s  # tensor parallelism
    span = tracer.start_span(
        "Execute", context=ctx, kind=SpanKind.SERVER, attributes=attrs, start_time=perf_counter_to_ns(timings.start)
    )
    if span.is_recording() and timings.forward_start:
        inner = trace.set_span_in_context(span)
        phases = (
            ("prepare_inputs", timings.start, timings.forward_start),
            ("forward", timings.forward_start, timings.sample_start),
            ("sample", timings.sample_start, timings.end),
        )
        for name, t0, t1 in phases:
            tracer.start_span(name, context=inner, start_time=perf_counter_to_ns(t0)).end(
                end_time=perf_counter_to_ns(t1)
            )
    for c in compiles or []:
        attrs_c = {"pagoda.structured_output.kind": c.kind, "pagoda.structured_output.cache_hit": c.cache_hit}
        attrs_c["pagoda.structured_output.compile_s"] = c.seconds
        span.add_event("structured_output.compile", attributes=attrs_c, timestamp=perf_counter_to_ns(c.start))
    span.end(end_time=perf_counter_to_ns(end))
