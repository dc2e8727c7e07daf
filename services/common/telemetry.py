"""OpenTelemetry tracing of one service process: configured from flags and the standard OTEL_* variables.

With no endpoint (neither `--otlp-traces-endpoint` nor `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`), or with
`OTEL_SDK_DISABLED=true` / `OTEL_TRACES_EXPORTER=none`, `setup_tracing` returns None: no provider, no interceptor,
and the services skip every tracing branch (a `None` check per request, nothing per token).

Health and reflection calls are never traced, nor the scheduler's `Stats` (scraped by the frontend's /metrics),
so a probe every second does not create a trace every second.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from urllib.parse import urlparse

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from services.common.flags import add_flag, optional_str

log = structlog.get_logger(__name__)

FRONTEND_SERVICE_NAME = "pagoda-frontend"
SCHEDULER_SERVICE_NAME = "pagoda-scheduler"
WORKER_SERVICE_NAME = "pagoda-worker"
TRACER_NAME = "pagoda"

# gRPC services and methods that are never traced (probes and scrapes).
_HEALTH = "grpc.health.v1.Health"
_REFLECTION_PREFIX = "grpc.reflection."
# NOTE: `Stream` carries many requests for the process's lifetime: each request gets its own spans instead.
_UNTRACED_METHODS = ("Stats", "Stream")


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--otlp-traces-endpoint",
        default=None,
        type=optional_str,
        help="OTLP collector for traces, e.g. http://localhost:4317 (default: OTEL_EXPORTER_OTLP_*; none: off)",
    )
    add_flag(
        parser,
        "--collect-detailed-traces",
        default=False,
        type=bool,
        help="also trace engine steps and the worker's Execute (only steps serving a sampled request, rate-capped)",
    )


@dataclass(frozen=True)
class TracingSettings:
    service_name: str  # the default; OTEL_SERVICE_NAME wins
    endpoint: str | None = None  # --otlp-traces-endpoint; None: the OTEL_* variables decide
    detailed: bool = False  # --collect-detailed-traces

    @classmethod
    def from_args(cls, args: argparse.Namespace, service_name: str) -> TracingSettings:
        return cls(service_name, args.otlp_traces_endpoint, args.collect_detailed_traces)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() == "true"


def resolve_endpoint(settings: TracingSettings) -> str | None:
    """Where traces go, or None when tracing is off."""
    if _env_true("OTEL_SDK_DISABLED") or os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return (
        settings.endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def resolve_protocol() -> str:
    # NOTE: grpc by default (as vLLM, and Jaeger's 4317), although the OTel spec's default is http/protobuf.
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")
    return protocol


def create_exporter(settings: TracingSettings) -> SpanExporter:
    """The OTLP exporter. From the flag the endpoint is used as given (http: `/v1/traces` added to a bare host);
    without it the exporter reads the OTEL_EXPORTER_OTLP_* variables itself (headers, TLS, timeout included)."""
    protocol = resolve_protocol()
    endpoint = settings.endpoint
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    if endpoint and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()


def _traced(details: object) -> bool:
    """The interceptors' filter: True for calls that get a span."""
    return not (
        filters.service_name(_HEALTH)(details)
        or filters.service_prefix(_REFLECTION_PREFIX)(details)
        or any(filters.method_name(m)(details) for m in _UNTRACED_METHODS)
    )


class Telemetry:
    """The tracer of a process whose tracing is on (a process with tracing off has `None` instead)."""

    def __init__(self, provider: TracerProvider, detailed: bool = False) -> None:
        self.provider = provider
        self.detailed = detailed
        self.tracer = provider.get_tracer(TRACER_NAME)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For `grpc.aio.server(interceptors=...)`: a server span per call, its parent from the caller's metadata."""
        return [aio_server_interceptor(tracer_provider=self.provider, filter_=_traced)]

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """For `grpc.aio.insecure_channel(interceptors=...)`: a client span per call, injected as `traceparent`."""
        return list(aio_client_interceptors(tracer_provider=self.provider, filter_=_traced))

    def shutdown(self) -> None:
        """Flushes pending spans and stops the exporter (the end of a SIGTERM drain)."""
        self.provider.shutdown()


def setup_tracing(settings: TracingSettings) -> Telemetry | None:
    endpoint = resolve_endpoint(settings)
    if endpoint is None:
        return None
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: settings.service_name}
    # NOTE: no sampler argument: the SDK reads OTEL_TRACES_SAMPLER(_ARG), default parentbased_always_on.
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(create_exporter(settings)))
    # NOTE: global too, so the HTTP instrumentation and any library span join the same provider.
    trace.set_tracer_provider(provider)
    log.info("tracing on", endpoint=endpoint, protocol=resolve_protocol(), detailed=settings.detailed)
    return Telemetry(provider, settings.detailed)
