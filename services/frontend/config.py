"""Frontend flags and environment -> a typed config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_core.config import default_cache_dir
from services.common.engine_flags import MODEL_FIELDS, add_engine_flags
from services.common.flags import add_flag


@dataclass
class FrontendConfig:
    host: str
    grpc_port: int
    http_port: int | None  # None: no HTTP API
    scheduler_addr: str
    model: str | None  # for the tokenizer (the weights live on the workers)
    tokenizer: str | None
    cache_dir: str
    max_inflight: int
    scheduler_timeout: float
    drain_timeout: float


def parse_frontend_args(argv: list[str] | None = None) -> FrontendConfig:
    p = argparse.ArgumentParser(prog="pagoda frontend", description="Pagoda frontend: gRPC + OpenAI HTTP API")
    add_flag(p, "--host", default="0.0.0.0", help="address to bind (gRPC and HTTP)")
    add_flag(p, "--grpc-port", default=50051, type=int, help="public gRPC port (0 picks a free one)")
    add_flag(p, "--http-port", default=8000, type=int, help="OpenAI-compatible HTTP port (-1 disables it)")
    add_flag(p, "--scheduler-addr", default="localhost:50052", help="the scheduler's address")
    add_engine_flags(p, MODEL_FIELDS)
    add_flag(p, "--max-inflight", default=4096, type=int, help="requests in flight before RESOURCE_EXHAUSTED")
    add_flag(p, "--scheduler-timeout", default=600.0, type=float, help="seconds to wait for the scheduler at start")
    add_flag(p, "--drain-timeout", default=60.0, type=float, help="seconds to finish in-flight streams on SIGTERM")
    a = p.parse_args(argv)
    return FrontendConfig(
        host=a.host,
        grpc_port=a.grpc_port,
        http_port=None if a.http_port < 0 else a.http_port,
        scheduler_addr=a.scheduler_addr,
        model=a.model,
        tokenizer=a.tokenizer,
        cache_dir=default_cache_dir(),
        max_inflight=a.max_inflight,
        scheduler_timeout=a.scheduler_timeout,
        drain_timeout=a.drain_timeout,
    )
