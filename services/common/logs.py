"""structlog setup shared by the services: JSON lines on stdout, console rendering on a terminal
(PAGODA_LOG_FORMAT=json|console overrides).

Lines about a request carry `request_id`, `trace_id` and `span_id`: callers pass them (see `request_fields`), and
a line logged inside a recording OpenTelemetry span gets that span's ids.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from opentelemetry import trace

from services.common.trace import TraceContext


def request_fields(request_id: str, tc: TraceContext) -> dict[str, str]:
    """The fields of a log line about one request (the trace ids are empty when the request has no trace)."""
    return {"request_id": request_id, "trace_id": tc.trace_id, "span_id": tc.span_id}


def add_trace_ids(_logger: object, _method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
    """The current span's ids, for lines logged while a span is current (and not given explicitly)."""
    if "trace_id" not in event:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event["trace_id"] = f"{ctx.trace_id:032x}"
            event["span_id"] = f"{ctx.span_id:016x}"
    return event


def configure_logging(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("PAGODA_LOG_LEVEL", "info")).upper()
    fmt = os.environ.get("PAGODA_LOG_FORMAT", "console" if sys.stdout.isatty() else "json")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    pid = os.getpid()

    def add_service(_logger: object, _method: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        # NOTE: a processor, not contextvars: contextvars do not reach threads such as the engine loop.
        event.setdefault("service", service)
        event.setdefault("pid", pid)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_service,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=True,
    )
    # NOTE: libraries (uvicorn, transformers) log through stdlib logging; keep them on stderr at the same level.
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level_name, logging.INFO), format="%(message)s")
