"""The scheduler's KV-event fan-out: numbered batches, a mirror of the resident hashes, bounded subscribers.

Runs on the event loop, never on the step loop's thread: the engine thread hands each step's events over with one
`call_soon_threadsafe`, and `publish` only appends to each subscriber's bounded outbox. A subscriber whose outbox is
full (it reads slower than the engine steps) is dropped: its stream ends with RESOURCE_EXHAUSTED and it resubscribes
(a snapshot, or a replay when the batches it missed are still held). The mirror is what the hub itself applied, so a
snapshot and the batches after it are consistent by construction.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Iterator

from engine_core.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from services.rpc import scheduler_pb2

MAX_SUBSCRIBERS = 64
MAX_PENDING_BATCHES = 1024  # per subscriber: then it is dropped
REPLAY_BATCHES = 4096  # held for a subscriber that reconnects with from_seq
SNAPSHOT_CHUNK = 16384  # hashes per snapshot message (32 bytes each: 512 KiB)


def event_to_proto(event: KvEvent) -> scheduler_pb2.KvEvent:
    if isinstance(event, BlockStored):
        return scheduler_pb2.KvEvent(
            stored=scheduler_pb2.KvBlockStored(
                block_hashes=event.block_hashes,
                parent_hash=event.parent_hash or b"",
                block_size=event.block_size,
                cache_salt_scope=event.cache_salt_scope,
            )
        )
    if isinstance(event, BlockRemoved):
        return scheduler_pb2.KvEvent(removed=scheduler_pb2.KvBlockRemoved(block_hashes=event.block_hashes))
    return scheduler_pb2.KvEvent(cleared=scheduler_pb2.KvAllBlocksCleared())


class KvSubscriber:
    """One WatchKvEvents stream's outbox."""

    def __init__(self, max_pending: int) -> None:
        self.pending: deque[scheduler_pb2.KvEventBatch] = deque()
        self.max_pending = max_pending
        self.dropped = False
        self.wake = asyncio.Event()

    def offer(self, batch: scheduler_pb2.KvEventBatch) -> bool:
        """Queues a batch; False (and dropped) when the outbox is full."""
        if len(self.pending) >= self.max_pending:
            self.dropped = True
            self.pending.clear()  # NOTE: what it would have read is stale anyway: it resubscribes
        else:
            self.pending.append(batch)
        self.wake.set()
        return not self.dropped


class KvEventHub:
    def __init__(
        self,
        max_subscribers: int = MAX_SUBSCRIBERS,
        max_pending: int = MAX_PENDING_BATCHES,
        replay: int = REPLAY_BATCHES,
    ) -> None:
        self.seq = 0
        self.stream_id = uuid.uuid4().hex
        self.resident: dict[bytes, None] = {}  # NOTE: a dict, not a set: a snapshot lists hashes in insertion order
        self.block_size = 0
        self.subscribers: set[KvSubscriber] = set()
        self.max_subscribers = max_subscribers
        self.max_pending = max_pending
        self._replay: deque[scheduler_pb2.KvEventBatch] = deque(maxlen=replay)
        self.num_dropped = 0

    def publish(self, events: list[KvEvent]) -> None:
        """One step's events (in order): applied to the mirror, numbered, offered to every subscriber."""
        if not events:
            return
        for event in events:
            if isinstance(event, BlockStored):
                self.block_size = event.block_size
                for h in event.block_hashes:
                    self.resident[h] = None
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.resident.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.resident.clear()
        self.seq += 1
        batch = scheduler_pb2.KvEventBatch(
            seq=self.seq,
            events=[event_to_proto(e) for e in events],
            block_size=self.block_size,
            stream_id=self.stream_id,
        )
        self._replay.append(batch)
        for sub in list(self.subscribers):
            if not sub.offer(batch):
                self.subscribers.discard(sub)
                self.num_dropped += 1

    def subscribe(self, from_seq: int, stream_id: str = "") -> KvSubscriber:
        """A new subscriber, its outbox primed with a replay after `from_seq` or a snapshot. Raises OverflowError
        when the hub already has its maximum of subscribers."""
        if len(self.subscribers) >= self.max_subscribers:
            raise OverflowError(f"{len(self.subscribers)} KV-event subscribers already: retry later")
        sub = KvSubscriber(self.max_pending)
        oldest = self._replay[0].seq if self._replay else self.seq + 1
        if stream_id == self.stream_id and 0 < from_seq <= self.seq and from_seq + 1 >= oldest:
            sub.pending.extend(b for b in self._replay if b.seq > from_seq)
        else:
            sub.pending.extend(self.snapshot())
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: KvSubscriber) -> None:
        self.subscribers.discard(sub)

    def snapshot(self) -> Iterator[scheduler_pb2.KvEventBatch]:
        """The resident hashes as of batch `seq`: the first message resets, the rest add."""
        hashes = list(self.resident)
        for start in range(0, max(len(hashes), 1), SNAPSHOT_CHUNK):
            yield scheduler_pb2.KvEventBatch(
                seq=self.seq,
                reset=start == 0,
                resident_hashes=hashes[start : start + SNAPSHOT_CHUNK],
                block_size=self.block_size,
                stream_id=self.stream_id,
            )
