"""W3C trace context (traceparent/tracestate): taken from incoming metadata, carried in every internal message.

With tracing on (services/common/telemetry.py) the services convert between these and OpenTelemetry span contexts
with `span_context_of` and `TraceContext.of_span`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from opentelemetry.trace import Span, SpanContext, TraceFlags, TraceState

from services.rpc import common_pb2

# version-traceid-parentid-flags, e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


@dataclass(frozen=True)
class TraceContext:
    traceparent: str = ""
    tracestate: str = ""

    def as_dict(self) -> dict[str, str]:
        """The shape engine_core's Request.trace_context takes (empty when no trace)."""
        if not self.traceparent:
            return {}
        out = {"traceparent": self.traceparent}
        if self.tracestate:
            out["tracestate"] = self.tracestate
        return out

    def to_proto(self) -> common_pb2.TraceContext:
        return common_pb2.TraceContext(traceparent=self.traceparent, tracestate=self.tracestate)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata to propagate the context on an outgoing call."""
        return tuple((k, v) for k, v in self.as_dict().items())

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        return self.traceparent[36:52]

    @classmethod
    def of_span(cls, span: Span) -> TraceContext:
        """The W3C context of an OpenTelemetry span (empty for an invalid one)."""
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return cls()
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        return cls(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state)

    @classmethod
    def from_proto(cls, msg: common_pb2.TraceContext) -> TraceContext:
        return cls.parse(msg.traceparent, msg.tracestate)

    @classmethod
    def from_dict(cls, d: Mapping[str, str]) -> TraceContext:
        return cls.parse(d.get("traceparent", ""), d.get("tracestate", ""))

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, str | bytes]] | None) -> TraceContext:
        """From gRPC invocation metadata or HTTP headers (keys are lower-case in both)."""
        found: dict[str, str] = {}
        for key, value in metadata or ():
            k = key.lower()
            if k in ("traceparent", "tracestate"):
                found[k] = value.decode() if isinstance(value, bytes) else value
        return cls.from_dict(found)

    @classmethod
    def parse(cls, traceparent: str, tracestate: str = "") -> TraceContext:
        # NOTE: an invalid traceparent is dropped (as the W3C spec asks), never an error for the request.
        traceparent = traceparent.strip().lower()
        if not _TRACEPARENT.match(traceparent):
            return cls()
        return cls(traceparent, tracestate.strip())


def span_context_of(tc: TraceContext) -> SpanContext | None:
    """A remote OpenTelemetry SpanContext from a W3C traceparent (None when there is none)."""
    if not tc.traceparent:
        return None
    _, trace_id, span_id, flags = tc.traceparent.split("-")
    return SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(flags, 16)),
        trace_state=TraceState.from_header([tc.tracestate]) if tc.tracestate else None,
    )
