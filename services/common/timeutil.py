"""Timestamps that cross process boundaries: Unix-epoch nanoseconds (monotonic clocks are per process)."""

from __future__ import annotations

import time

from engine_core.core.request import Request
from services.rpc import common_pb2


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(t: float | None) -> int:
    """A time.monotonic() reading of this process as Unix nanoseconds (0 for None)."""
    if t is None:
        return 0
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def request_timestamps(request: Request, arrival_ns: int = 0) -> common_pb2.RequestTimestamps:
    """The engine's per-request timings (monotonic, this process) as a RequestTimestamps message."""
    t = request.timings
    return common_pb2.RequestTimestamps(
        arrival_ns=arrival_ns,
        queued_ns=monotonic_to_ns(t.arrival),
        scheduled_ns=monotonic_to_ns(t.first_scheduled),
        first_token_ns=monotonic_to_ns(t.first_token),
        finished_ns=monotonic_to_ns(t.finished),
    )


def perf_counter_to_ns(t: float) -> int:
    """A time.perf_counter() reading of this process as Unix nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - t) * 1e9)
