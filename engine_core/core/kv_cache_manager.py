"""Per-sequence block tables over the block pool: prefix lookup, slot allocation, forking and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.core.block_pool import BlockPool, KVBlock
from engine_core.core.kv_events import salt_scope
from engine_core.core.prefix_cache import extend_block_hashes
from engine_core.core.request import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[int, list[KVBlock]] = {}
        self._hashes: dict[int, list[bytes]] = {}
        self._num_registered: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, [])]

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        return extend_block_hashes(hashes, seq.token_ids, self.block_size, seq.request.cache_salt)

    def lookup_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Longest run of cached full blocks for a sequence with nothing computed yet.

        NOTE: the hit stops at least one token short of the sequence, so the last token is computed and its
        logits exist. Requests that want prompt logprobs skip the cache: they need every prompt position.
        """
        if not self.enable_caching or seq.request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.target_tokens - 1) // self.block_size if seq.target_tokens > 0 else 0
        hit: list[KVBlock] = []
        for block_hash in self._block_hashes(seq)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def record_prefix_lookup(self, seq: Sequence, hit: list[KVBlock]) -> None:
        """Counts an admitted sequence's lookup in the hit-rate stats.

        NOTE: not counted in `lookup_prefix`: a request blocked at the head of the queue is looked up every step.
        """
        if not self.enable_caching or seq.request.sampling_params.prompt_logprobs is not None:
            return
        self.stats.queries += seq.num_prompt_tokens
        self.stats.hits += min(len(hit) * self.block_size, seq.num_prompt_tokens)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: list[KVBlock] | None = None) -> int:
        """New blocks `allocate` would take for `num_new_tokens` more tokens (after `prefix`)."""
        prefix = prefix or []
        held = len(self.tables.get(seq.seq_id, ())) + len(prefix)
        computed = seq.num_computed_tokens + len(prefix) * self.block_size
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - held)

    def _available(self, prefix: list[KVBlock]) -> int:
        # Free-but-cached prefix blocks leave the free queue when revived: they are not available twice.
        return self.pool.num_free - sum(1 for b in prefix if b.ref_cnt == 0)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix: list[KVBlock] | None = None) -> list[int] | None:
        """Adds the prefix-hit blocks and enough new blocks for `num_new_tokens` more tokens.

        Returns the ids of every block appended to the table (prefix then new), or None when the pool is short.
        """
        prefix = prefix or []
        needed = self.blocks_needed(seq, num_new_tokens, prefix)
        if needed > self._available(prefix):
            return None
        table = self.tables.setdefault(seq.seq_id, [])
        self.pool.touch(prefix)
        table.extend(prefix)
        new = self.pool.allocate(needed)
        table.extend(new)
        return [b.block_id for b in prefix + new]

    def fork(self, parent: Sequence, child: Sequence, copies: list[tuple[int, int]]) -> bool:
        """Child shares the parent's full blocks; a partial last block is copied (recorded in `copies`).

        Returns False (and changes nothing) when no block is free for the copy.
        """
        table = self.tables[parent.seq_id]
        num_full = parent.num_computed_tokens // self.block_size
        partial = table[num_full] if len(table) > num_full and parent.num_computed_tokens % self.block_size else None
        if partial is not None and self.pool.num_free < 1:
            return False
        shared = table[:num_full]
        self.pool.touch(shared)
        child_table = list(shared)
        if partial is not None:
            (copy,) = self.pool.allocate(1)
            copies.append((partial.block_id, copy.block_id))
            child_table.append(copy)
        self.tables[child.seq_id] = child_table
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, []))
        self._num_registered[child.seq_id] = min(self._num_registered.get(parent.seq_id, 0), num_full)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's blocks that are now full of computed tokens in the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self._num_registered.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq)
        table = self.tables[seq.seq_id]
        events = self.pool.events
        if events is None:
            for i in range(start, num_full):
                self.pool.register(table[i], hashes[i])
        else:
            stored = [hashes[i] for i in range(start, num_full) if self.pool.register(table[i], hashes[i])]
            # NOTE: the parent of the first block written here (a duplicate in between still chains: the router
            # keeps a set of hashes, and a duplicate's hash is resident through its twin).
            parent = hashes[start - 1] if start else None
            events.stored(stored, parent, self.block_size, salt_scope(seq.request.cache_salt))
        self._num_registered[seq.seq_id] = num_full

    def free(self, seq: Sequence) -> None:
        """Returns every block of the sequence, tail first (tails are evicted before shared heads)."""
        table = self.tables.pop(seq.seq_id, [])
        self.pool.free(reversed(table))
        self._num_registered.pop(seq.seq_id, None)
        if seq.is_finished:
            self._hashes.pop(seq.seq_id, None)  # a preempted sequence keeps its hashes for the resume lookup
