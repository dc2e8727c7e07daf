"""KV-cache events: what entered and left the prefix cache, for routers that place requests where their prefix is.

The block pool and the KV cache manager append to a `KvEventBuffer` (when one is attached; none by default, so the
step loop pays nothing when nobody listens); the scheduler service takes the buffer's events once per step and
publishes them off the step loop's thread. A hash here is exactly the prefix-cache key (`prefix_cache.hash_block`),
so any process that hashes a prompt with the same block size and salt knows which of its blocks a replica holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class BlockStored:
    """Full blocks registered in the prefix cache, in chain order (each the child of the one before)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None  # the chain's block before the first (None: the first is a sequence's first block)
    block_size: int
    # NOTE: a digest, never the salt itself: the salt may be a tenant's secret, and the router hashes with its own.
    cache_salt_scope: str = ""


@dataclass
class BlockRemoved:
    """Cached blocks whose hash was dropped (evicted for reuse, or the prefix cache reset)."""

    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class AllBlocksCleared:
    """The whole cache is gone (a fresh engine after a worker reset, or the first engine)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def salt_scope(cache_salt: str | None) -> str:
    """A short public name for a salt's scope: equal salts share it, the salt cannot be read back from it."""
    if not cache_salt:
        return ""
    return hashlib.sha256(b"pagoda-salt-scope:" + cache_salt.encode()).hexdigest()[:16]


class KvEventBuffer:
    """The events of the engine thread since the last `take` (one step's worth: bounded by the pool's size)."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def stored(self, block_hashes: list[bytes], parent_hash: bytes | None, block_size: int, scope: str) -> None:
        if block_hashes:
            self.events.append(BlockStored(block_hashes, parent_hash, block_size, scope))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)  # NOTE: a step's evictions usually come in a run: one event
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
