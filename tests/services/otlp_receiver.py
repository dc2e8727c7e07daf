"""An OTLP/gRPC trace receiver for tests: the protocol Jaeger ingests on 4317, served by `opentelemetry-proto`'s
TraceService on 127.0.0.1. Services export to it exactly as they would to a collector."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from services.launcher import free_port


def _value(v: common_pb2.AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: list[common_pb2.KeyValue]) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    events: list[tuple[str, int, dict[str, object]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)
    status_code: int = 0


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = []
        for rs in request.resource_spans:
            service = str(_attrs(list(rs.resource.attributes)).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(_convert(service, s))
        with self.receiver.lock:
            self.receiver.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _convert(service: str, s: trace_pb2.Span) -> ReceivedSpan:
    return ReceivedSpan(
        service=service,
        name=s.name,
        trace_id=s.trace_id.hex(),
        span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex(),
        kind=s.kind,
        start_ns=s.start_time_unix_nano,
        end_ns=s.end_time_unix_nano,
        attributes=_attrs(list(s.attributes)),
        events=[(e.name, e.time_unix_nano, _attrs(list(e.attributes))) for e in s.events],
        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
        status_code=s.status.code,
    )


class OtlpReceiver:
    """Collects every exported span; `wait_for` polls until a condition on them holds."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"condition not met within {timeout:.0f} s; spans so far: {names}")
            time.sleep(0.1)
