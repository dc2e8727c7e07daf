"""W3C trace context (traceparent/tracestate): taken from incoming metadata, carried in every internal message.

Full OpenTelemetry tracing is a later step; it only has to read `TraceContext` messages and metadata written here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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
