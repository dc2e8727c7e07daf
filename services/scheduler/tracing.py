"""The scheduler's spans: a request's phases from the engine's own record, and one span per engine step.

Request: the `Submit` server span (the gRPC interceptor's, child of the frontend's call) gets children `queue`,
`prefill` and `decode` built from `RequestTimings` after the request ends, an event per preemption and resume, and
vLLM's latency attributes. Its context becomes the request's `trace_context`, which the worker receives.

Steps (`--collect-detailed-traces`): a `step` span per engine step that serves a sampled request, at most
`MAX_STEP_SPANS_PER_SECOND`. One step serves many traces (TGI's batch-span pattern): it links to every sampled
request it serves, and it is the child of the first of them in batch order (the oldest running one), so a request
served alone has its steps, and the worker's `Execute` under them, in its own trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind

from engine_core.core.request import Request
from engine_core.plan import NewSequenceData, SchedulerOutput
from services.common.timeutil import monotonic_to_ns
from services.common.trace import TraceContext, span_context_of

# NOTE: a busy engine runs tens to hundreds of steps per second; past this rate step spans are dropped (the
# request spans are not), so a detailed trace never floods the collector.
MAX_STEP_SPANS_PER_SECOND = 20.0
MAX_STEP_LINKS = 32


SUBMIT_SPAN = "/pagoda.v1.Scheduler/Submit"  # a request's server span, on `Submit` (the interceptor's) or `Stream`


def request_span(tracer: trace.Tracer, parent: TraceContext) -> Span:
    """A `Stream` request's own server span (a `Submit` call's is the interceptor's), named as `Submit`'s: its
    parent is the frontend's call span (SubmitRequest.trace), so a request stays one trace across the processes."""
    remote = span_context_of(parent)
    context = trace.set_span_in_context(trace.NonRecordingSpan(remote)) if remote is not None else None
    return tracer.start_span(SUBMIT_SPAN, context=context, kind=SpanKind.SERVER)


def record_request(tracer: trace.Tracer, span: Span, request: Request) -> None:
    """Children, events and attributes of a finished request's `Submit` span, from the engine's timestamps."""
    if not span.is_recording():
        return
    t = request.timings
    end = t.finished if t.finished is not None else time.monotonic()
    parent = trace.set_span_in_context(span)

    def child(name: str, start: float | None, stop: float | None) -> None:
        if start is None or stop is None or stop < start:
            return
        tracer.start_span(name, context=parent, start_time=monotonic_to_ns(start)).end(end_time=monotonic_to_ns(stop))

    scheduled = t.first_scheduled
    child("queue", t.arrival, scheduled if scheduled is not None else end)
    child("prefill", scheduled, t.first_token if t.first_token is not None else (end if scheduled else None))
    child("decode", t.first_token, end)
    for event in t.events:
        span.add_event(
            event.kind.value,
            attributes={"pagoda.choice.index": event.index, "pagoda.sequence.num_tokens": event.num_tokens},
            timestamp=monotonic_to_ns(event.time),
        )
    num_preemptions = sum(s.num_preemptions for s in request.seqs)
    attrs: dict[str, str | int | float] = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": sum(s.num_output_tokens for s in request.seqs),
        "pagoda.prefix_cache.hit_tokens": max((max(s.num_cached_tokens, 0) for s in request.seqs), default=0),
        "pagoda.request.num_preemptions": num_preemptions,
        "pagoda.request.num_steps": t.num_steps,
        "gen_ai.latency.e2e": end - t.arrival,
    }
    if t.num_draft_tokens:
        attrs["pagoda.spec_decode.num_draft_tokens"] = t.num_draft_tokens
        attrs["pagoda.spec_decode.num_accepted_tokens"] = t.num_accepted_tokens
    if t.beam is not None:
        attrs["gen_ai.request.beam_width"] = t.beam.width
        attrs["pagoda.beam.steps"] = t.beam.steps
        attrs["pagoda.beam.forked"] = t.beam.forked
        attrs["pagoda.beam.pruned"] = t.beam.pruned
    if scheduled is not None:
        attrs["gen_ai.latency.time_in_queue"] = scheduled - t.arrival
    if t.first_token is not None:
        attrs["gen_ai.latency.time_to_first_token"] = t.first_token - t.arrival
        if scheduled is not None:
            attrs["gen_ai.latency.time_in_model_prefill"] = t.first_token - scheduled
        attrs["gen_ai.latency.time_in_model_decode"] = end - t.first_token
    span.set_attributes(attrs)


# Who a new sequence serves: its request id and the W3C context of the request's Submit span.
Identify = Callable[[NewSequenceData], tuple[str, TraceContext]]


def identify(new: NewSequenceData) -> tuple[str, TraceContext]:
    """From the plan itself (the scheduler copies each request's context into its new sequences)."""
    return new.request_id, TraceContext.parse(new.trace_context, new.trace_state)


class StepTracer:
    """Opens the span of one engine step (engine thread only) and hands its context to the Execute message.

    It follows the plan's deltas as a worker does (new sequences arrive with their request's context, finished ones
    leave), so a step's links cost a dict lookup per scheduled sequence, and only with detailed traces on.
    """

    def __init__(
        self, tracer: trace.Tracer, identify: Identify = identify, max_per_second: float = MAX_STEP_SPANS_PER_SECOND
    ) -> None:
        self.tracer = tracer
        self.identify = identify
        self.max_per_second = max_per_second
        self._tokens = max_per_second  # token bucket: up to one second's worth in a burst
        self._refilled = time.monotonic()
        self._sampled: dict[int, tuple[str, SpanContext]] = {}  # seq_id -> (request_id, its sampled context)

    def reset(self) -> None:
        """A new cache epoch: the sequence ids start over."""
        self._sampled.clear()

    def _follow(self, plan: SchedulerOutput) -> None:
        for seq_id in plan.finished_seq_ids:
            self._sampled.pop(seq_id, None)
        for new in plan.new_seqs:
            request_id, tc = self.identify(new)
            ctx = span_context_of(tc)
            if ctx is not None and ctx.trace_flags.sampled:
                self._sampled[new.seq_id] = (request_id, ctx)

    def _allow_soon(self) -> bool:
        """True when the bucket holds a token by now (checked before scanning the batch)."""
        return self._tokens + (time.monotonic() - self._refilled) * self.max_per_second >= 1.0

    def _take(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.max_per_second, self._tokens + (now - self._refilled) * self.max_per_second) - 1.0
        self._refilled = now

    def start(self, plan: SchedulerOutput, step: int) -> Span | None:
        """The step's span, or None (no sampled request in it, or over the rate cap)."""
        self._follow(plan)
        if plan.is_empty or not self._sampled or not self._allow_soon():
            return None
        links: list[Link] = []
        seen: set[str] = set()
        num_decode = 0
        drafts = plan.scheduled_spec_decode_tokens
        for seq_id, n in plan.num_scheduled_tokens.items():
            num_decode += n == 1 + len(drafts.get(seq_id, ()))  # a verification row is a decode row
            entry = self._sampled.get(seq_id)
            if entry is None or entry[0] in seen or len(links) >= MAX_STEP_LINKS:
                continue
            seen.add(entry[0])
            links.append(Link(entry[1], {"gen_ai.request.id": entry[0]}))
        if not links:
            return None
        self._take()
        batch = len(plan.num_scheduled_tokens)
        num_drafts = sum(len(d) for d in drafts.values())
        # NOTE: decode rows schedule one token; a one-token prefill chunk would count as decode (rare, harmless).
        attrs = {
            "pagoda.step.index": step,
            "pagoda.step.batch_size": batch,
            "pagoda.step.num_scheduled_tokens": plan.total_num_scheduled_tokens,
            "pagoda.step.num_decode_seqs": num_decode,
            "pagoda.step.num_prefill_seqs": batch - num_decode,
            "pagoda.step.num_prefill_tokens": plan.total_num_scheduled_tokens - num_decode - num_drafts,
            "pagoda.step.num_new_seqs": len(plan.new_seqs),
            "pagoda.step.num_linked_requests": len(links),
        }
        if drafts:
            attrs["pagoda.step.num_draft_tokens"] = num_drafts
        parent = trace.set_span_in_context(trace.NonRecordingSpan(links[0].context))
        return self.tracer.start_span("step", context=parent, kind=SpanKind.CLIENT, links=links, attributes=attrs)
