"""structlog setup shared by the services: JSON lines when not on a terminal (or PAGODA_LOG_FORMAT=json)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("PAGODA_LOG_LEVEL", "info")).upper()
    fmt = os.environ.get("PAGODA_LOG_FORMAT", "console" if sys.stderr.isatty() else "json")
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
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # NOTE: libraries (uvicorn, transformers) log through stdlib logging; keep them on stderr at the same level.
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level_name, logging.INFO), format="%(message)s")
