"""Worker flags and environment -> a typed config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_core.config import EngineConfig
from services.common import ports
from services.common.engine_flags import MODEL_FIELDS, WORKER_FIELDS, add_engine_flags, engine_config_from_args
from services.common.flags import add_flag
from services.common.telemetry import WORKER_SERVICE_NAME, TracingSettings, add_tracing_flags
from services.common.tls import TlsFiles


@dataclass
class WorkerConfig:
    host: str
    port: int
    engine: EngineConfig
    rank: int  # of engine.tensor_parallel_size: which shard this worker loads
    drain_timeout: float  # seconds to keep serving steps after SIGTERM
    drain_idle: float  # after SIGTERM, exit once no step arrived for this long
    metrics_port: int  # Prometheus /metrics (-1: off)
    tracing: TracingSettings
    tls: TlsFiles


def parse_worker_args(argv: list[str] | None = None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="pagoda worker", description="Pagoda worker: runs the model on the KV cache")
    add_flag(p, "--host", default="127.0.0.1", help="address to bind (internal: loopback unless told otherwise)")
    add_flag(p, "--worker-port", default=ports.WORKER_PORT, type=int, help="gRPC port (0 picks a free one)")
    add_engine_flags(p, MODEL_FIELDS + WORKER_FIELDS)
    add_flag(
        p, "--rank", default=0, type=int, help="tensor-parallel rank (< --tensor-parallel-size): the shard to load"
    )
    # NOTE: longer than the scheduler's 20 s, so the worker serves the steps of the scheduler's whole drain.
    add_flag(p, "--drain-timeout", default=25.0, type=float, help="seconds to drain after SIGTERM")
    add_flag(p, "--drain-idle", default=1.0, type=float, help="idle seconds that end a drain")
    add_flag(
        p,
        "--metrics-port",
        default=ports.WORKER_METRICS_PORT,
        type=int,
        help="Prometheus /metrics port on --host (-1 disables)",
    )
    add_tracing_flags(p)
    TlsFiles.add_flags(p)
    a = p.parse_args(argv)
    try:
        tls = TlsFiles.from_args(a)
        engine = engine_config_from_args(a, MODEL_FIELDS + WORKER_FIELDS)
    except ValueError as e:
        p.error(str(e))
    if not 0 <= a.rank < engine.tensor_parallel_size:
        p.error(f"--rank {a.rank} is outside --tensor-parallel-size {engine.tensor_parallel_size}")
    tracing = TracingSettings.from_args(a, WORKER_SERVICE_NAME)
    return WorkerConfig(
        a.host, a.worker_port, engine, a.rank, a.drain_timeout, a.drain_idle, a.metrics_port, tracing, tls
    )
