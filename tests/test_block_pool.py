"""KVBlock / FreeBlockQueue / BlockPool: LRU order, reference counts, registration and eviction."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_core.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine_core.core.prefix_cache import hash_block


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def h(i: int) -> bytes:
    return hash_block(None, [i])


# ---- FreeBlockQueue ---------------------------------------------------------------------------------------------
def test_queue_keeps_insertion_order_and_count() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.num_free == 4
    assert blocks[0].prev is None and blocks[0].next is None


def test_queue_remove_from_middle_and_reinsert_at_both_ends() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3]
    q.appendleft(blocks[2])
    assert ids(q) == [2, 0, 1, 3]
    q.remove(blocks[3])  # the last one
    q.append(blocks[3])
    q.remove(blocks[2])  # the first one
    assert ids(q) == [0, 1, 3]
    assert q.num_free == 3


def test_queue_empty_pop_raises_and_remove_of_absent_block_asserts() -> None:
    b = KVBlock(0)
    q = FreeBlockQueue([b])
    q.popleft()
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        q.popleft()
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(b)
    assert q.num_free == 0 and list(q) == []


# ---- BlockPool ----------------------------------------------------------------------------------------------------
def test_allocate_takes_from_head_with_one_reference() -> None:
    pool = BlockPool(4, enable_caching=True)
    got = pool.allocate(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free == 1
    assert pool.usage == pytest.approx(0.75)


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, enable_caching=True)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert ids(pool.free_queue) == [2]


def test_free_puts_uncached_blocks_first_in_line_and_cached_last() -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.register(b, h(1))
    pool.register(c, h(2))
    # tail first, as KVCacheManager.free does
    pool.free([d, c, b, a])
    # uncached d and a go to the head (a last, so first); cached c then b go to the tail
    assert ids(pool.free_queue) == [0, 3, 4, 5, 2, 1]
    # the next allocations reuse uncached blocks first; cached contents survive longest
    assert ids(pool.allocate(4)) == [0, 3, 4, 5]
    assert pool.lookup(h(1)) is b and pool.lookup(h(2)) is c
    assert pool.num_evictions == 0


def test_double_free_raises() -> None:
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free == 2


def test_touch_revives_a_free_cached_block_and_shares_a_used_one() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.free([a])
    assert pool.num_free == 2
    hit = pool.lookup(h(1))
    assert hit is a
    pool.touch([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 2
    assert pool.num_free == 1 and a not in list(pool.free_queue)
    # a revived block is not handed out again
    (c,) = pool.allocate(1)
    assert c.block_id == 2
    assert a.block_hash == h(1)


def test_register_is_first_come_and_duplicates_stay_private() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(1))  # same content computed twice
    assert pool.lookup(h(1)) is a and b.block_hash is None
    pool.register(a, h(2))  # a registered block keeps its first hash
    assert a.block_hash == h(1) and pool.lookup(h(2)) is None


def test_register_is_a_no_op_without_caching() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.register(a, h(1))
    assert a.block_hash is None and pool.lookup(h(1)) is None


def test_reusing_a_cached_block_evicts_it() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.free([b, a])
    assert ids(pool.free_queue) == [1, 0]
    pool.allocate(1)  # b: uncached, nothing evicted
    assert pool.num_evictions == 0
    (again,) = pool.allocate(1)
    assert again is a
    assert a.block_hash is None and pool.lookup(h(1)) is None
    assert pool.num_evictions == 1


def test_evicting_a_private_duplicate_keeps_the_cached_original() -> None:
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(1))  # b holds the same tokens but stays private
    pool.free([a, b])
    pool.allocate(1)  # reuses b (uncached, head)
    assert pool.lookup(h(1)) is a


def test_reset_prefix_cache_drops_only_unreferenced_blocks() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, h(1))
    pool.register(b, h(2))
    pool.free([a])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(h(1)) is None and a.block_hash is None
    assert pool.lookup(h(2)) is b
    assert pool.num_free == 2  # a stays free, now uncached


# ---- model-based: the pool against a plain-list model of the LRU queue --------------------------------------------
class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / touch / free / register / reset against a list model of the free queue."""

    NUM_BLOCKS = 6

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, enable_caching=True)
        self.held: list[KVBlock] = []  # one entry per reference we hold
        self.model_queue: list[int] = list(range(self.NUM_BLOCKS))
        self.model_cache: dict[bytes, int] = {}
        self.next_hash = 0

    @rule(n=st.integers(0, 3))
    def allocate(self, n: int) -> None:
        if n > len(self.model_queue):
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        expected, self.model_queue = self.model_queue[:n], self.model_queue[n:]
        assert ids(got) == expected
        for block in got:
            self.model_cache = {k: v for k, v in self.model_cache.items() if v != block.block_id}
        self.held += got

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free([block])
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self.model_queue.insert(0, block.block_id)
            else:
                self.model_queue.append(block.block_id)

    @precondition(lambda self: self.model_cache)
    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model_cache)))
        block = self.pool.lookup(key)
        assert block is not None and block.block_id == self.model_cache[key]
        self.pool.touch([block])
        if block.block_id in self.model_queue:
            self.model_queue.remove(block.block_id)
        self.held.append(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.held))
        key = h(self.next_hash)
        self.next_hash += 1
        if block.block_hash is None:
            self.model_cache[key] = block.block_id
        self.pool.register(block, key)

    @rule()
    def reset(self) -> None:
        dropped = self.pool.reset_prefix_cache()
        free = set(self.model_queue)
        assert dropped == sum(1 for v in self.model_cache.values() if v in free)
        self.model_cache = {k: v for k, v in self.model_cache.items() if v not in free}

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        assert ids(pool.free_queue) == self.model_queue
        assert pool.num_free == len(self.model_queue)
        for block in pool.blocks:
            assert block.ref_cnt == sum(1 for b in self.held if b is block)
            assert (block.ref_cnt == 0) == (block.block_id in self.model_queue)
        assert {k: b.block_id for k, b in pool.cached.items()} == self.model_cache
        for key, block in pool.cached.items():
            assert block.block_hash == key


BlockPoolMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
