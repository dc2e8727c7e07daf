"""What KV-cache events cost per engine step: the engine thread's buffer appends, and the event loop's publish to
0 or 10 subscribers that never read (until they are dropped), for a step that stores and evicts a few blocks.

    python benchmarks/kv_events_overhead.py [--steps 20000]

Both arms interleaved in one run; compare the per-step microseconds with a decode step's milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import time

from engine_core.core.kv_events import KvEventBuffer
from services.scheduler.kv_event_hub import KvEventHub


def step_events(buffer: KvEventBuffer, hashes: list[bytes], removed: int) -> None:
    """What the block pool and the KV cache manager add in one step (the hashes exist already: the prefix cache's)."""
    for h in hashes[:removed]:
        buffer.removed(h)
    buffer.stored(hashes[removed:], hashes[0], 16, "")


def measure(steps: int, subscribers: int, stored: int, removed: int) -> tuple[float, float]:
    """(engine-thread µs per step, event-loop µs per step)."""
    hub = KvEventHub()
    subs = [hub.subscribe(0) for _ in range(subscribers)]
    buffer = KvEventBuffer()
    engine_s = loop_s = 0.0
    for i in range(steps):
        hashes = [hashlib.sha256(f"{i}-{k}".encode()).digest() for k in range(stored + removed)]
        t0 = time.perf_counter()
        step_events(buffer, hashes, removed)
        events = buffer.take()
        t1 = time.perf_counter()
        hub.publish(events)
        t2 = time.perf_counter()
        engine_s += t1 - t0
        loop_s += t2 - t1
    assert all(s.dropped for s in subs) or steps < 1024
    return engine_s / steps * 1e6, loop_s / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--stored", type=int, default=2, help="blocks stored per step")
    p.add_argument("--removed", type=int, default=2, help="blocks evicted per step")
    args = p.parse_args()
    rows: dict[int, list[tuple[float, float]]] = {0: [], 10: []}
    for _ in range(5):  # interleaved
        for n in rows:
            rows[n].append(measure(args.steps // 5, n, args.stored, args.removed))
    for n, r in rows.items():
        engine = sorted(x[0] for x in r)[len(r) // 2]
        loop = sorted(x[1] for x in r)[len(r) // 2]
        print(f"{n:2d} slow subscribers: engine thread {engine:6.1f} µs/step, event loop {loop:6.1f} µs/step")


if __name__ == "__main__":
    main()
