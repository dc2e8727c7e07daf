"""The generated Protobuf and gRPC modules, (re)built on first import when missing or stale."""

from __future__ import annotations

from services.pb_build import ensure_generated

ensure_generated()

from services.pb import (  # noqa: E402 - generated just above
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

GENERATION_SERVICE = "pagoda.v1.Generation"
SCHEDULER_SERVICE = "pagoda.v1.Scheduler"
WORKER_SERVICE = "pagoda.v1.Worker"

__all__ = [
    "GENERATION_SERVICE",
    "SCHEDULER_SERVICE",
    "WORKER_SERVICE",
    "common_pb2",
    "generation_pb2",
    "generation_pb2_grpc",
    "scheduler_pb2",
    "scheduler_pb2_grpc",
    "worker_pb2",
    "worker_pb2_grpc",
]
