"""Timestamps that cross process boundaries: Unix-epoch nanoseconds (monotonic clocks are per process)."""

from __future__ import annotations

import time


def now_ns() -> int:
    return time.time_ns()


def monotonic_to_ns(t: float | None) -> int:
    """A time.monotonic() reading of this process as Unix nanoseconds (0 for None)."""
    if t is None:
        return 0
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def perf_counter_to_ns(t: float) -> int:
    """A time.perf_counter() reading of this process as Unix nanoseconds."""
    return time.time_ns() - int((time.perf_counter() - t) * 1e9)
