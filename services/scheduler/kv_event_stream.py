"""One WatchKvEvents stream: the subscriber's outbox drained onto the wire, with the load at most every 100 ms."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from services.rpc import scheduler_pb2
from services.scheduler.kv_event_hub import KvEventHub

LOAD_INTERVAL_S = 0.1  # NOTE: ~10 Hz: fresh enough to balance on, cheap for 64 subscribers


async def watch_kv_events(
    hub: KvEventHub,
    from_seq: int,
    stream_id: str,
    load: Callable[[], scheduler_pb2.KvLoad],
    context: grpc.aio.ServicerContext,
) -> AsyncIterator[scheduler_pb2.KvEventBatch]:
    if from_seq < 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "from_seq must be >= 0")
    try:
        sub = hub.subscribe(from_seq, stream_id)
    except OverflowError as e:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    last_seq = 0
    last_load: scheduler_pb2.KvLoad | None = None
    next_load = 0.0
    loop = asyncio.get_running_loop()
    try:
        while True:
            while sub.pending and not sub.dropped:
                # NOTE: the await of a yield is the flow control: a client that does not read stalls here while
                # the hub keeps filling the outbox, until it is dropped.
                batch = sub.pending.popleft()
                last_seq = batch.seq
                yield batch
            if sub.dropped:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"KV-event subscriber fell more than {sub.max_pending} batches behind: resubscribe",
                )
            now = loop.time()
            if now >= next_load:
                current = load()
                if current != last_load:
                    last_load = current
                    # NOTE: the seq of the last batch sent: a load message never advances the caller's position.
                    yield scheduler_pb2.KvEventBatch(seq=last_seq, load=current, has_load=True, stream_id=hub.stream_id)
                next_load = now + LOAD_INTERVAL_S
            sub.wake.clear()
            if not sub.pending:
                # NOTE: asyncio.timeout, not wait_for: no task per wait (Python 3.11's wait_for wraps one), and
                # this waits ~10 times a second for as long as a router subscribes.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(next_load):
                        await sub.wake.wait()
    finally:
        hub.unsubscribe(sub)
