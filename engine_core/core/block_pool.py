"""The pool of KV blocks: reference counts, an O(1) LRU free queue, and the hash -> block map of the prefix cache.

A block with ref_cnt == 0 sits in the free queue but keeps its contents and hash until it is handed out again,
so a later request with the same prefix can revive it (a prefix-cache hit takes it out of the middle in O(1)).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from engine_core.core.kv_events import KvEventBuffer


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    prev: KVBlock | None = None
    next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks, least recently freed at the head (evicted first)."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev is not None and block.next is not None, f"{block} is not in the free queue"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        last.next, block.prev, block.next, self._tail.prev = block, last, self._tail, block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        assert first is not None
        self._head.next, block.prev, block.next, first.prev = block, self._head, first, block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.events: KvEventBuffer | None = None  # KV-cache events for routers (scheduler service); None: off

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Takes n blocks from the head of the free queue, evicting their cached contents."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops a reference; callers pass a sequence's blocks tail-first so tails are evicted before heads."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # NOTE: uncached blocks hold nothing reusable: put them first in line for reuse.
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: bytes) -> bool:
        """Makes a full block findable by its hash. A duplicate (same tokens computed twice) stays private.

        Returns whether the hash is new to the cache."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Forgets every unreferenced cached block (e.g. after weights change). Returns how many were dropped."""
        dropped = 0
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                self._evict(block)
                dropped += 1
        return dropped
