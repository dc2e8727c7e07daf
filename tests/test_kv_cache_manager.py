"""KVCacheManager: prefix lookup, allocation, fork with copy-on-write, registration and tail-first freeing."""

from __future__ import annotations

import itertools

import pytest

from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.prefix_cache import extend_block_hashes
from engine_core.core.request import Request, Sequence, SequenceStatus
from engine_core.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


def make_seq(prompt: list[int], *, salt: str | None = None, prompt_logprobs: int | None = None) -> Sequence:
    params = SamplingParams(prompt_logprobs=prompt_logprobs)
    request = Request(f"r{next(_ids)}", list(prompt), params, cache_salt=salt)
    seq = Sequence(next(_ids), request, 0, list(prompt), len(prompt))
    request.seqs.append(seq)
    return seq


def compute(kv: KVCacheManager, seq: Sequence, n: int, prefix: list | None = None) -> list[int]:
    """What the scheduler does for one admitted/running step: allocate, count the tokens computed, register."""
    got = kv.allocate(seq, n, prefix)
    assert got is not None
    seq.num_computed_tokens += len(prefix or []) * kv.block_size + n
    kv.cache_computed_blocks(seq)
    return got


def finish(kv: KVCacheManager, seq: Sequence) -> None:
    seq.status = SequenceStatus.FINISHED
    kv.free(seq)


def test_lookup_finds_the_cached_prefix_but_always_leaves_the_last_token() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    first = make_seq(list(range(12)))
    compute(kv, first, 12)
    assert len(kv.pool.cached) == 3
    finish(kv, first)
    # exactly 3 full blocks: only 2 may be hits, the last token must be computed for its logits
    assert len(kv.lookup_prefix(make_seq(list(range(12))))) == 2
    assert len(kv.lookup_prefix(make_seq(list(range(13))))) == 3
    assert len(kv.lookup_prefix(make_seq(list(range(7)) + [99] * 6))) == 1
    assert kv.lookup_prefix(make_seq([99, *range(1, 12)])) == []


def test_lookup_hit_blocks_are_the_registered_ones_in_order() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    first = make_seq(list(range(10)))
    compute(kv, first, 10)
    table = list(kv.tables[first.seq_id])
    hit = kv.lookup_prefix(make_seq([*range(10), 5, 5]))
    assert hit == table[:2]


def test_lookup_is_empty_for_prompt_logprobs_and_without_caching() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    compute(kv, make_seq(list(range(12))), 12)
    assert kv.lookup_prefix(make_seq(list(range(12)), prompt_logprobs=1)) == []
    off = KVCacheManager(16, BS, enable_caching=False)
    seq = make_seq(list(range(12)))
    compute(off, seq, 12)
    assert off.pool.cached == {} and all(b.block_hash is None for b in off.tables[seq.seq_id])
    assert off.lookup_prefix(make_seq(list(range(12)))) == []


def test_salt_isolates_the_prefix() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    compute(kv, make_seq(list(range(9)), salt="a"), 9)
    assert len(kv.lookup_prefix(make_seq(list(range(9)), salt="a"))) == 2
    assert kv.lookup_prefix(make_seq(list(range(9)), salt="b")) == []
    assert kv.lookup_prefix(make_seq(list(range(9)))) == []


def test_allocate_returns_prefix_then_new_ids_and_refuses_when_short() -> None:
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_seq(list(range(9)))
    compute(kv, a, 9)  # 3 blocks, 2 full and registered
    finish(kv, a)
    b = make_seq(list(range(9)) + [7] * 8)  # 17 tokens = 5 blocks: 2 hits + 3 new
    hit = kv.lookup_prefix(b)
    assert len(hit) == 2
    # the 2 hit blocks are free, so only 2 of the 4 free blocks are available for new ones
    assert kv.allocate(b, 17 - 8, hit) is None
    assert kv.num_free_blocks == 4 and b.seq_id not in kv.tables
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    # 12 tokens fit: 2 hits + 1 new block
    got = kv.allocate(b, 4, hit)
    assert got is not None and got[:2] == [blk.block_id for blk in hit] and len(got) == 3
    assert kv.block_ids(b.seq_id) == got
    assert [blk.ref_cnt for blk in hit] == [1, 1]
    assert kv.num_free_blocks == 1


def test_allocate_only_adds_blocks_when_the_last_one_is_full() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    seq = make_seq([1, 2, 3])
    assert len(compute(kv, seq, 3)) == 1
    seq.token_ids.append(4)
    assert compute(kv, seq, 1) == []  # fills slot 3 of block 0
    seq.token_ids.append(5)
    assert len(compute(kv, seq, 1)) == 1
    assert len(kv.tables[seq.seq_id]) == 2


def test_cache_computed_blocks_registers_only_full_computed_blocks() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    seq = make_seq(list(range(11)))
    compute(kv, seq, 6)  # chunk 1: block 0 full, block 1 half
    table = kv.tables[seq.seq_id]
    hashes = extend_block_hashes([], seq.token_ids, BS, None)
    assert table[0].block_hash == hashes[0] and table[1].block_hash is None
    compute(kv, seq, 5)  # chunk 2: block 1 full, block 2 has 3 of 4
    assert [b.block_hash for b in table] == [hashes[0], hashes[1], None]
    assert kv.pool.lookup(hashes[1]) is table[1]


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    parent = make_seq(list(range(10)))
    compute(kv, parent, 9)  # 2 full blocks + 1 token in the third
    child = Sequence(99, parent.request, 1, list(parent.token_ids), parent.num_prompt_tokens)
    child.num_computed_tokens = parent.num_computed_tokens
    copies: list[tuple[int, int]] = []
    assert kv.fork(parent, child, copies)
    p, c = kv.tables[parent.seq_id], kv.tables[child.seq_id]
    assert c[:2] == p[:2] and [b.ref_cnt for b in p[:2]] == [2, 2]
    assert c[2] is not p[2] and p[2].ref_cnt == 1 and c[2].ref_cnt == 1
    assert copies == [(p[2].block_id, c[2].block_id)]
    assert kv.num_free_blocks == 8 - 4


def test_fork_at_a_block_boundary_copies_nothing() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    parent = make_seq(list(range(9)))
    compute(kv, parent, 8)
    child = Sequence(99, parent.request, 1, list(parent.token_ids), parent.num_prompt_tokens)
    copies: list[tuple[int, int]] = []
    assert kv.fork(parent, child, copies)
    assert copies == [] and kv.tables[child.seq_id] == kv.tables[parent.seq_id]
    assert [b.ref_cnt for b in kv.tables[parent.seq_id]] == [2, 2]


def test_fork_without_a_free_block_changes_nothing() -> None:
    kv = KVCacheManager(3, BS, enable_caching=True)
    parent = make_seq(list(range(10)))
    compute(kv, parent, 9)
    child = Sequence(99, parent.request, 1, list(parent.token_ids), parent.num_prompt_tokens)
    copies: list[tuple[int, int]] = []
    assert not kv.fork(parent, child, copies)
    assert copies == [] and child.seq_id not in kv.tables
    assert [b.ref_cnt for b in kv.tables[parent.seq_id]] == [1, 1, 1]


def test_free_is_tail_first_so_tails_are_evicted_before_heads() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    seq = make_seq(list(range(13)))
    compute(kv, seq, 13)  # blocks 0..2 full (cached), block 3 holds one token (uncached)
    table = list(kv.tables[seq.seq_id])
    finish(kv, seq)
    queue = [b.block_id for b in kv.pool.free_queue]
    # the uncached tail is first in line; cached blocks are at the end, the deepest block evicted first
    assert queue[0] == table[3].block_id
    assert queue[-3:] == [table[2].block_id, table[1].block_id, table[0].block_id]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.tables == {}


def test_shared_blocks_survive_until_the_last_holder_frees() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_seq(list(range(9)))
    compute(kv, a, 9)
    b = make_seq(list(range(9)))
    hit = kv.lookup_prefix(b)
    compute(kv, b, 1, hit)
    finish(kv, a)
    assert [blk.ref_cnt for blk in hit] == [1, 1]
    finish(kv, b)
    assert kv.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.free(hit)


def test_a_preempted_sequence_keeps_its_hashes_a_finished_one_does_not() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    seq = make_seq(list(range(9)))
    compute(kv, seq, 9)
    kv.free(seq)  # preempted: still WAITING
    assert seq.seq_id in kv._hashes
    seq.num_computed_tokens = 0
    assert len(kv.lookup_prefix(seq)) == 2
    finish(kv, seq)
    assert seq.seq_id not in kv._hashes


def test_stats_count_recorded_lookups_only() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_seq(list(range(10)))
    hit = kv.lookup_prefix(a)
    compute(kv, a, 10, hit)
    kv.record_prefix_lookup(a, hit)
    b = make_seq(list(range(10)))
    hit = kv.lookup_prefix(b)
    kv.lookup_prefix(b)  # a retry (b blocked at the head of the queue) is not a new query
    compute(kv, b, 2, hit)
    kv.record_prefix_lookup(b, hit)
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    kv.record_prefix_lookup(make_seq(list(range(10)), prompt_logprobs=0), [])  # bypasses the cache
    assert kv.stats.queries == 20
