"""A router's picture of one scheduler's prefix cache, rebuilt from its WatchKvEvents stream.

The hashes are the scheduler's prefix-cache keys, so the frontend hashes a prompt with the same function
(`engine_core.core.prefix_cache.extend_block_hashes`, same block size and salt) and counts how many of its leading
blocks are resident. A gap in the batch numbers means events were missed: the caller resubscribes (from `seq`).
"""

from __future__ import annotations

from services.rpc import scheduler_pb2


class KvIndex:
    def __init__(self) -> None:
        self.resident: set[bytes] = set()
        self.seq = 0  # the last batch applied (0: none yet)
        self.stream_id = ""  # whose numbering `seq` is
        self.block_size = 0
        self.load: scheduler_pb2.KvLoad | None = None

    def apply(self, batch: scheduler_pb2.KvEventBatch) -> bool:
        """Applies one message; False on a gap (nothing applied: resubscribe from `seq`)."""
        if batch.block_size:
            self.block_size = batch.block_size
        if batch.has_load:
            self.load = batch.load
        if batch.reset:
            self.resident.clear()
            self.stream_id = batch.stream_id
        if batch.reset or batch.resident_hashes:
            self.resident.update(batch.resident_hashes)
            self.seq = batch.seq
            return True
        if not batch.events:
            return True  # load only: never moves the position
        if batch.seq != self.seq + 1:
            return False
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "stored":
                self.resident.update(event.stored.block_hashes)
            elif kind == "removed":
                self.resident.difference_update(event.removed.block_hashes)
            elif kind == "cleared":
                self.resident.clear()
        self.seq = batch.seq
        return True

    def cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt's hash chain are resident (the prefill a hit would save)."""
        n = 0
        for h in block_hashes:
            if h not in self.resident:
                break
            n += 1
        return n
