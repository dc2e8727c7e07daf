"""KV-cache events: a subscriber that joins late, reconnects or replays rebuilds exactly the pool's cached hashes
(driven by the real scheduler under eviction pressure); a subscriber that stops reading is dropped, never waited on."""

from __future__ import annotations

import random

from engine_core.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBuffer, salt_scope
from engine_core.core.prefix_cache import extend_block_hashes
from engine_core.core.scheduler import Scheduler
from services.frontend.kv_index import KvIndex
from services.scheduler.kv_event_hub import KvEventHub, KvSubscriber
from tests.scheduler_sim import Harness, make_request, make_scheduler


def drain(sub: KvSubscriber, index: KvIndex) -> None:
    while sub.pending:
        assert index.apply(sub.pending.popleft())


def cached(sched: Scheduler) -> set[bytes]:
    return set(sched.kv.pool.cached)


def tenant_prompts(rng: random.Random, n: int) -> list[tuple[list[int], str | None]]:
    """Requests of 6 tenants, each with its own 12-token system prompt, some salted, with distinct tails."""
    systems = [[rng.randrange(10, 40) for _ in range(12)] for _ in range(6)]
    out = []
    for _ in range(n):
        t = rng.randrange(6)
        tail = [rng.randrange(10, 40) for _ in range(rng.randrange(1, 14))]
        out.append((systems[t] + tail, "salt-a" if t == 5 else None))
    return out


def test_late_and_reconnecting_subscribers_rebuild_the_resident_set_under_eviction() -> None:
    rng = random.Random(7)
    h = Harness(make_scheduler(num_blocks=24, block_size=4, max_num_seqs=4), seed=1)
    pool = h.sched.kv.pool
    pool.events = buffer = KvEventBuffer()
    hub = KvEventHub(replay=16)
    early = hub.subscribe(0)
    early_index = KvIndex()
    reconnecting_index = KvIndex()
    reconnecting = hub.subscribe(0)
    late: list[tuple[KvSubscriber, KvIndex]] = []
    pending = tenant_prompts(rng, 60)
    step = 0
    while pending or h.sched.has_unfinished:
        if pending and len(h.sched.requests) < 6:
            prompt, salt = pending.pop()
            h.add(make_request(prompt, max_tokens=rng.randrange(1, 6), cache_salt=salt))
        h.step()
        hub.publish(buffer.take())
        step += 1
        drain(early, early_index)
        assert early_index.resident == cached(h.sched), f"step {step}"
        if step % 7 == 0:  # a router that restarts: a snapshot, then the live stream
            late.append((hub.subscribe(0), KvIndex()))
        if step % 5 == 0 and reconnecting in hub.subscribers:
            drain(reconnecting, reconnecting_index)
            hub.unsubscribe(reconnecting)  # a dropped connection: the next one asks for what came after its seq
        if step % 5 == 2:
            reconnecting = hub.subscribe(reconnecting_index.seq, reconnecting_index.stream_id)
        for sub, index in late:
            drain(sub, index)
    drain(reconnecting, reconnecting_index)
    assert pool.num_evictions > 10, "the workload must evict for the test to mean anything"
    for sub, index in [(early, early_index), *late]:
        drain(sub, index)
        assert index.resident == cached(h.sched)
    assert reconnecting_index.resident == cached(h.sched)
    assert early_index.seq == hub.seq == reconnecting_index.seq
    assert len(late) >= 5


def test_a_reconnect_older_than_the_replay_window_gets_a_snapshot() -> None:
    hub = KvEventHub(replay=2)
    hashes = extend_block_hashes([], list(range(12)), 4, None)
    for h in hashes:
        hub.publish([BlockStored([h], None, 4)])
    hub.publish([BlockRemoved([hashes[0]])])
    assert hub.subscribe(hub.seq - 1, "another-scheduler").pending[0].reset  # another numbering: a snapshot
    replay = hub.subscribe(hub.seq - 1, hub.stream_id)
    assert [b.seq for b in replay.pending] == [hub.seq] and not replay.pending[0].reset
    old = hub.subscribe(1, hub.stream_id)  # batches 2.. are no longer all held: a snapshot instead
    assert old.pending[0].reset
    index = KvIndex()
    drain(old, index)
    assert index.resident == set(hashes[1:]) and index.seq == hub.seq
    assert index.cached_blocks(hashes) == 0 and index.cached_blocks(hashes[1:]) == 2


def test_a_gap_is_refused_and_a_clear_empties_the_index() -> None:
    hub = KvEventHub()
    sub = hub.subscribe(0)
    index = KvIndex()
    drain(sub, index)
    h = extend_block_hashes([], [1, 2, 3, 4], 4, "t")
    hub.publish([BlockStored(h, None, 4, salt_scope("t"))])
    hub.publish([BlockStored(extend_block_hashes([], [5, 6, 7, 8], 4, None), None, 4)])
    sub.pending.popleft()  # missed
    assert not index.apply(sub.pending.popleft())
    assert index.resident == set() and index.seq == 0
    hub.publish([AllBlocksCleared()])
    again = hub.subscribe(index.seq, index.stream_id)
    drain(again, index)
    assert index.resident == set() == set(hub.resident)


def test_a_slow_subscriber_is_dropped_and_the_others_keep_every_batch() -> None:
    hub = KvEventHub(max_pending=8)
    slow = hub.subscribe(0)
    fast, fast_index = hub.subscribe(0), KvIndex()
    for i in range(40):
        hub.publish([BlockStored([bytes([i]) * 32], None, 4)])  # never blocks: publish only appends
        drain(fast, fast_index)
    assert slow.dropped and slow not in hub.subscribers and not slow.pending
    assert hub.num_dropped == 1
    assert fast in hub.subscribers and len(fast_index.resident) == 40 == len(hub.resident)


def test_the_salt_scope_names_the_salt_without_revealing_it() -> None:
    assert salt_scope(None) == salt_scope("") == ""
    assert salt_scope("tenant-a") == salt_scope("tenant-a") != salt_scope("tenant-b")
    assert "tenant-a" not in salt_scope("tenant-a")


def test_no_buffer_no_events_and_a_duplicate_block_is_not_stored_twice() -> None:
    h = Harness(make_scheduler(num_blocks=16, block_size=4))
    assert h.sched.kv.pool.events is None
    buffer = h.sched.kv.pool.events = KvEventBuffer()
    prompt = list(range(10, 19))
    h.add(make_request(prompt, max_tokens=1))
    h.add(make_request(prompt, max_tokens=1))  # scheduled together: both compute the same two blocks
    h.run()
    stored = [x for e in buffer.take() if isinstance(e, BlockStored) for x in e.block_hashes]
    assert stored == extend_block_hashes([], prompt, 4, None)
