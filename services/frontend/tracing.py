"""The frontend's spans of one request: `{operation} {model}` (OpenTelemetry GenAI conventions) with children for
tokenization and detokenization.

The span starts in `RequestPipeline.prepare` as a child of the current server span (gRPC `Generate` or the HTTP
request, whose parent is the client's `traceparent`), and its context, not the client's, goes to the scheduler.
Only created when tracing is on; detokenization is timed only while the span is recording.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from engine_core.io.request_output import RequestOutput
from engine_core.sampling_params import SamplingParams
from services.common.timeutil import perf_counter_to_ns

PROVIDER_NAME = "pagoda"
SUBMIT_CALL = "/pagoda.v1.Scheduler/Submit"


def operation_name(is_chat: bool) -> str:
    return "chat" if is_chat else "text_completion"


def request_attributes(
    operation: str, model: str, params: SamplingParams, stream: bool
) -> dict[str, str | bool | int | float]:
    attrs: dict[str, str | bool | int | float] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
        "gen_ai.request.stream": stream,
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = params.max_tokens
    if params.top_k > 0:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    return attrs


class RequestSpan:
    """The GenAI span of one request, opened at admission and ended when the stream ends."""

    def __init__(self, tracer: trace.Tracer, name: str, attributes: dict[str, str | bool | int | float]) -> None:
        self.tracer = tracer
        self.span = tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attributes)
        self.context = trace.set_span_in_context(self.span)
        self.recording = self.span.is_recording()
        self._detok_first = 0.0
        self._detok_last = 0.0
        self._detok_busy = 0.0
        self._detok_calls = 0
        self._call: Span | None = None

    def call_span(self) -> Span:
        """The request's call to the scheduler (a CLIENT span, named as the RPC; the scheduler's span is its
        child). NOTE: the requests share one `Stream` call, so the interceptor's span per call is not theirs."""
        self._call = self.tracer.start_span(SUBMIT_CALL, context=self.context, kind=SpanKind.CLIENT)
        return self._call

    def tokenize_span(self) -> Span:
        return self.tracer.start_span("tokenize", context=self.context)

    def detokenize_begin(self) -> float:
        return time.perf_counter() if self.recording else 0.0

    def detokenize_end(self, t0: float) -> None:
        if not self.recording:
            return
        t1 = time.perf_counter()
        if not self._detok_calls:
            self._detok_first = t0
        self._detok_last = t1
        self._detok_busy += t1 - t0
        self._detok_calls += 1

    def finish(
        self,
        request_id: str,
        output: RequestOutput | None,
        num_prompt_tokens: int,
        error_type: str | None = None,
        message: str = "",
    ) -> None:
        span = self.span
        if self.recording and self._detok_calls:
            # NOTE: one span from the first to the last output processed (a span per message would be a span per
            # token); its busy time is an attribute, since the stream's waits sit between the calls.
            detok = self.tracer.start_span(
                "detokenize", context=self.context, start_time=perf_counter_to_ns(self._detok_first)
            )
            detok.set_attribute("pagoda.detokenize.busy_seconds", self._detok_busy)
            detok.set_attribute("pagoda.detokenize.calls", self._detok_calls)
            detok.end(end_time=perf_counter_to_ns(self._detok_last))
        if self.recording:
            span.set_attribute("gen_ai.response.id", request_id)
            span.set_attribute("gen_ai.usage.input_tokens", num_prompt_tokens)
            if output is not None:
                reasons: Sequence[str] = [c.finish_reason or "" for c in output.outputs]
                span.set_attribute("gen_ai.response.finish_reasons", list(reasons))
                span.set_attribute("gen_ai.usage.output_tokens", sum(len(c.token_ids) for c in output.outputs))
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", output.num_cached_tokens)
                if error_type is None and any(r in ("abort", "error") for r in reasons):
                    error_type = next(r for r in reasons if r in ("abort", "error"))
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, message or error_type))
        if self._call is not None:
            if error_type is not None:
                self._call.set_status(Status(StatusCode.ERROR, message or error_type))
            self._call.end()
        span.end()
