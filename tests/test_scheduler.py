"""Scheduler unit tests, driven without a model (tests/scheduler_sim.py: the worker and harness they run on)."""

from __future__ import annotations

import pytest

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, SequenceStatus
from engine_core.engine import EngineCore
from tests.scheduler_sim import (
    EOS,
    STOP,
    Harness,
    Worker,
    check_invariants,
    first_step_of,
    make_request,
    make_scheduler,
)


# ---- chunked prefill, budget, max_num_seqs ------------------------------------------------------------------------
def test_chunked_prefill_under_a_small_token_budget() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=4))
    a = h.add(make_request(list(range(10, 20)), max_tokens=2))
    b = h.add(make_request(list(range(20, 23)), max_tokens=2))
    sa, sb = a.seqs[0].seq_id, b.seqs[0].seq_id
    p1, p2, p3 = h.step(), h.step(), h.step()
    assert p1.num_scheduled_tokens == {sa: 4}
    assert [(n.seq_id, n.num_computed_tokens) for n in p1.new_seqs] == [(sa, 0)]
    assert p2.num_scheduled_tokens == {sa: 4} and p2.new_seqs == []
    assert [(c.seq_id, c.num_computed_tokens) for c in p2.cached_seqs] == [(sa, 4)]
    # the last 2 prompt tokens of a, then b's first chunk fills the rest of the budget
    assert p3.num_scheduled_tokens == {sa: 2, sb: 2}
    assert a.seqs[0].num_output_tokens == 1 and b.seqs[0].num_output_tokens == 0  # only a sampled
    p4 = h.step()
    assert p4.num_scheduled_tokens == {sa: 1, sb: 1}  # a's decode goes first, b's prefill finishes
    h.run()
    assert [s.num_output_tokens for s in (a.seqs[0], b.seqs[0])] == [2, 2]
    assert all(p.total_num_scheduled_tokens <= 4 for p in h.plans)


def test_max_num_seqs_caps_the_running_set() -> None:
    h = Harness(make_scheduler(max_num_seqs=2))
    reqs = [h.add(make_request([5, 6, 7], max_tokens=3 + i)) for i in range(3)]
    h.step()
    assert len(h.sched.running) == 2 and reqs[2].seqs[0].status is SequenceStatus.WAITING
    h.step()
    h.step()  # the first request finishes here (3 tokens)
    assert reqs[0].seqs[0].finish_reason is FinishReason.LENGTH
    h.step()
    assert reqs[2].seqs[0].status is SequenceStatus.RUNNING
    h.run()
    assert all(len(p.num_scheduled_tokens) <= 2 for p in h.plans)


def test_max_num_seqs_reserves_the_slots_of_a_request_that_will_fork() -> None:
    # n=3 takes one running slot until its prompt is computed, then three: nothing else may take them meanwhile
    h = Harness(make_scheduler(max_num_seqs=3, max_num_batched_tokens=4))
    h.add(make_request(list(range(10, 20)), n=3, max_tokens=3))
    h.add(make_request([5, 6, 7], max_tokens=3))
    h.run()
    assert all(len(p.num_scheduled_tokens) <= 3 for p in h.plans)


# ---- ordering -----------------------------------------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order_regardless_of_priority() -> None:
    h = Harness(make_scheduler(max_num_seqs=1))
    reqs = [h.add(make_request([5, 6, 7], max_tokens=2, priority=p)) for p in (3, 1, 2, 0)]
    h.run()
    first = first_step_of(h)
    order = sorted(reqs, key=lambda r: first[r.seqs[0].seq_id])
    assert order == reqs


def test_priority_policy_admits_lowest_value_first_then_arrival() -> None:
    h = Harness(make_scheduler(max_num_seqs=1, policy="priority"))
    reqs = [h.add(make_request([5, 6, 7], max_tokens=2, priority=p)) for p in (3, 1, 2, 1, 0)]
    h.run()
    first = first_step_of(h)
    order = sorted(reqs, key=lambda r: first[r.seqs[0].seq_id])
    assert [r.priority for r in order] == [0, 1, 1, 2, 3]
    assert order[1] is reqs[1] and order[2] is reqs[3]  # equal priorities: first come first served


def _grow_until_preemption(h: Harness) -> int:
    for _ in range(50):
        plan = h.step()
        if h.sched.num_preemptions:
            return len(h.plans) - 1
        assert plan.total_num_scheduled_tokens > 0
    raise AssertionError("no preemption")


@pytest.mark.parametrize(("policy", "victim_index"), [("fcfs", 1), ("priority", 0)])
def test_preemption_victim_is_lowest_priority_then_newest(policy: str, victim_index: int) -> None:
    # 6 blocks of 4: two 8-token prompts (2 blocks each) grow until the pool runs dry
    h = Harness(make_scheduler(num_blocks=6, policy=policy, max_model_len=24))
    old = h.add(make_request(list(range(10, 18)), max_tokens=12, priority=5))
    new = h.add(make_request(list(range(20, 28)), max_tokens=12, priority=0))
    step = _grow_until_preemption(h)
    victim = (old, new)[victim_index].seqs[0]
    survivor = (old, new)[1 - victim_index].seqs[0]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and survivor.num_preemptions == 0
    assert victim.seq_id not in h.sched.kv.tables
    assert victim.seq_id in h.plans[step].finished_seq_ids  # the worker is told to forget it
    assert list(h.plans[step].num_scheduled_tokens) == [survivor.seq_id]
    h.run()
    assert victim.num_output_tokens == survivor.num_output_tokens == 12


def test_preempted_sequence_resumes_from_its_cached_prefix() -> None:
    h = Harness(make_scheduler(num_blocks=8, max_model_len=64))
    a = h.add(make_request(list(range(10, 22)), max_tokens=6))
    b = h.add(make_request(list(range(30, 42)), max_tokens=10))
    sb = b.seqs[0]
    step = _grow_until_preemption(h)
    assert sb.status is SequenceStatus.WAITING and sb.num_tokens == 17
    tokens_at_preemption = list(sb.token_ids)
    h.run()
    # b came back in full, with its outputs so far, and its first 3 blocks (still cached) as computed
    resumed = [n for p in h.plans[step + 1 :] for n in p.new_seqs if n.seq_id == sb.seq_id]
    assert len(resumed) == 1
    assert resumed[0].token_ids == tokens_at_preemption
    assert resumed[0].num_computed_tokens == 12
    assert sb.num_cached_tokens == 0  # reported for the first admission only
    assert a.seqs[0].num_output_tokens == 6 and sb.num_output_tokens == 10
    assert sb.token_ids[:17] == tokens_at_preemption


def test_no_admission_in_a_step_that_preempted() -> None:
    h = Harness(make_scheduler(num_blocks=6, max_num_seqs=2, policy="priority", max_model_len=24))
    h.add(make_request(list(range(10, 18)), max_tokens=12, priority=1))
    b = h.add(make_request(list(range(20, 28)), max_tokens=12, priority=1))
    h.step()
    late = h.add(make_request([5], max_tokens=2, priority=0))  # waits: max_num_seqs
    step = _grow_until_preemption(h)
    assert b.seqs[0].status is SequenceStatus.WAITING
    # room for `late` appeared, but a step that preempted admits nobody (it would only thrash)
    assert late.seqs[0].seq_id not in h.plans[step].num_scheduled_tokens
    h.step()
    assert late.seqs[0].status is SequenceStatus.RUNNING
    h.run()


def test_preemption_by_recompute_without_prefix_caching_recomputes_everything() -> None:
    h = Harness(make_scheduler(num_blocks=8, max_model_len=64, caching=False))
    h.add(make_request(list(range(10, 22)), max_tokens=6))
    b = h.add(make_request(list(range(30, 42)), max_tokens=10))
    step = _grow_until_preemption(h)
    h.run()
    resumed = [n for p in h.plans[step + 1 :] for n in p.new_seqs if n.seq_id == b.seqs[0].seq_id]
    assert [n.num_computed_tokens for n in resumed] == [0]
    assert b.seqs[0].num_output_tokens == 10


# ---- admission errors -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [32, 40])
def test_prompt_not_shorter_than_max_model_len_is_rejected(length: int) -> None:
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match=rf"{length}.*32"):
        sched.add_request(make_request([5] * length))
    assert not sched.has_unfinished and sched.requests == {}


def test_other_admission_errors() -> None:
    sched = make_scheduler(max_num_seqs=2)
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request([]))
    with pytest.raises(ValueError, match=r"n \(3\) must be <= max_num_seqs \(2\)"):
        sched.add_request(make_request([1, 2], n=3))
    sched.add_request(make_request([1, 2], request_id="x"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request([1, 2], request_id="x"))


def test_prompt_larger_than_the_whole_kv_cache_is_rejected() -> None:
    # it could never be admitted, and strict FCFS would block every request behind it forever
    sched = make_scheduler(num_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match=r"17.*4"):
        sched.add_request(make_request([5] * 17))
    h = Harness(sched)
    h.add(make_request([5] * 16, max_tokens=1))  # exactly fits
    h.run()


# ---- finishing -------------------------------------------------------------------------------------------------------
def test_stop_token_eos_max_tokens_and_max_model_len_finish_sequences() -> None:
    h = Harness(make_scheduler(max_model_len=12))
    stop = h.add(make_request([5, 6], max_tokens=8))
    eos = h.add(make_request([5, 7], max_tokens=8))
    length = h.add(make_request([5, 8], max_tokens=2))
    model_len = h.add(make_request([5, 9], max_tokens=None))
    tokens = {stop.seqs[0].seq_id: [11, STOP], eos.seqs[0].seq_id: [EOS]}
    h.worker.sample = lambda seq_id: tokens[seq_id].pop(0) if tokens.get(seq_id) else 20
    h.run()
    assert (stop.seqs[0].finish_reason, stop.seqs[0].stop_reason) == (FinishReason.STOP_TOKEN, STOP)
    assert stop.seqs[0].output_token_ids == [11, STOP]
    assert (eos.seqs[0].finish_reason, eos.seqs[0].stop_reason) == (FinishReason.STOP_TOKEN, None)
    assert length.seqs[0].finish_reason is FinishReason.LENGTH and length.seqs[0].num_output_tokens == 2
    assert model_len.seqs[0].finish_reason is FinishReason.LENGTH and model_len.seqs[0].num_tokens == 12


def test_min_tokens_and_ignore_eos_suppress_stops() -> None:
    h = Harness(make_scheduler())
    r = h.add(make_request([5, 6], max_tokens=4, min_tokens=2, ignore_eos=True))
    h.worker.sample = lambda seq_id: EOS
    h.run()
    assert r.seqs[0].output_token_ids == [EOS] * 4 and r.seqs[0].finish_reason is FinishReason.LENGTH
    h2 = Harness(make_scheduler())
    r2 = h2.add(make_request([5, 6], max_tokens=4, min_tokens=2))
    h2.worker.sample = lambda seq_id: STOP
    h2.run()
    assert r2.seqs[0].output_token_ids == [STOP, STOP] and r2.seqs[0].finish_reason is FinishReason.STOP_TOKEN


def test_finish_seq_with_a_stop_string_frees_blocks_and_tells_the_worker() -> None:
    h = Harness(make_scheduler())
    r = h.add(make_request(list(range(10, 19)), max_tokens=8))
    h.step()
    h.step()
    seq = r.seqs[0]
    h.sched.finish_seq(seq, FinishReason.STOP_STRING, "stop!")
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP_STRING, "stop!")
    check_invariants(h.sched)
    assert h.sched.kv.num_free_blocks == 64 and h.sched.requests == {}
    plan = h.step()
    assert plan.finished_seq_ids == [seq.seq_id] and plan.is_empty
    assert h.worker.seqs == {}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("when", range(8))
def test_abort_frees_everything_at_any_time(n: int, when: int) -> None:
    h = Harness(make_scheduler(num_blocks=10, max_num_batched_tokens=5, max_model_len=64))
    r1 = h.add(make_request(list(range(10, 21)), n=n, max_tokens=6))
    r2 = h.add(make_request(list(range(10, 21)), max_tokens=6))  # shares r1's prefix
    for _ in range(when):
        if h.sched.has_unfinished:
            h.step()
    expected = None if r1.finished else r1
    assert h.sched.abort_request(r1.request_id) is expected
    h.step(before_update=lambda: h.sched.abort_request(r2.request_id))  # abort while the step "runs"
    assert not h.sched.has_unfinished
    assert h.sched.kv.num_free_blocks == 10 and h.sched.requests == {} and h.sched.seqs == {}
    assert all(s.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH) for s in r1.seqs + r2.seqs)
    h.step()
    assert h.worker.seqs == {}
    assert h.sched.abort_request(r1.request_id) is None


# ---- n > 1 -----------------------------------------------------------------------------------------------------------
def test_n_gt_1_shares_prompt_blocks_and_copies_the_partial_block() -> None:
    h = Harness(make_scheduler(num_blocks=16))
    r = h.add(make_request(list(range(10, 20)), n=3, max_tokens=4))
    parent = r.seqs[0]
    p1 = h.step()
    # the parent computes the first P-1 = 9 tokens alone and samples nothing
    assert p1.num_scheduled_tokens == {parent.seq_id: 9} and parent.num_output_tokens == 0
    p2 = h.step()
    assert len(r.seqs) == 3
    children = r.seqs[1:]
    ptable = h.sched.kv.tables[parent.seq_id]
    # 2 full blocks shared 3 ways; the partial third block (1 token) copied for each child
    assert [b.ref_cnt for b in ptable[:2]] == [3, 3]
    for child in children:
        ctable = h.sched.kv.tables[child.seq_id]
        assert ctable[:2] == ptable[:2] and ctable[2] is not ptable[2] and ctable[2].ref_cnt == 1
    assert p2.copy_blocks == [(ptable[2].block_id, h.sched.kv.tables[c.seq_id][2].block_id) for c in children]
    assert [(n.seq_id, n.num_computed_tokens) for n in p2.new_seqs] == [(c.seq_id, 9) for c in children]
    assert p2.num_scheduled_tokens == {parent.seq_id: 1, **{c.seq_id: 1 for c in children}}
    assert [s.num_output_tokens for s in r.seqs] == [1, 1, 1]
    assert len({s.token_ids[-1] for s in r.seqs}) > 1  # each choice samples on its own
    h.run()
    assert [s.index for s in r.seqs] == [0, 1, 2]
    assert all(s.num_output_tokens == 4 for s in r.seqs)


def test_n_gt_1_at_a_block_boundary_forks_without_copies() -> None:
    h = Harness(make_scheduler(num_blocks=16))
    r = h.add(make_request(list(range(10, 19)), n=2, max_tokens=3))  # P-1 = 8: two full blocks
    h.step()
    plan = h.step()
    assert plan.copy_blocks == []
    assert [b.ref_cnt for b in h.sched.kv.tables[r.seqs[0].seq_id][:2]] == [2, 2]
    h.run()


def test_n_gt_1_one_token_prompt_starts_the_choices_independently() -> None:
    h = Harness(make_scheduler())
    r = h.add(make_request([7], n=3, max_tokens=2))
    assert len(r.seqs) == 3 and not any(s.pending_fork for s in r.seqs)
    h.run()
    assert all(s.num_output_tokens == 2 for s in r.seqs)


def test_n_gt_1_fork_in_a_pool_too_small_for_all_copies_still_finishes() -> None:
    # P-1 = 14 tokens fill all 4 blocks; the child's copy of the partial block cannot be had while the parent runs
    h = Harness(make_scheduler(num_blocks=4, max_model_len=16))
    r = h.add(make_request(list(range(10, 25)), n=2, max_tokens=1))
    h.run(max_steps=50)
    assert [s.finish_reason for s in r.seqs] == [FinishReason.LENGTH, FinishReason.LENGTH]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_fork_preempts_later_sequences_for_its_copies_but_never_itself(policy: str) -> None:
    # 5 blocks of 4: the parent's 9 prompt tokens take 3, the other request's 7 take 2, none left for the copy
    h = Harness(make_scheduler(num_blocks=5, policy=policy, max_model_len=20))
    if policy == "priority":  # the forking request has the better priority: the other one is preempted
        r = h.add(make_request(list(range(10, 20)), n=2, max_tokens=3, priority=0))
        other = h.add(make_request(list(range(30, 37)), max_tokens=3, priority=1))
    else:  # the other request is older: the parent would be the victim, so its sibling waits instead
        other = h.add(make_request(list(range(30, 37)), max_tokens=3))
        r = h.add(make_request(list(range(10, 20)), n=2, max_tokens=3))
    h.step()
    assert h.sched.kv.num_free_blocks == 0
    plan = h.step()
    parent, child = r.seqs
    if policy == "priority":
        assert other.seqs[0].status is SequenceStatus.WAITING and h.sched.num_preemptions == 1
        assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 10
        assert plan.copy_blocks == [(h.sched.kv.block_ids(parent.seq_id)[2], h.sched.kv.block_ids(child.seq_id)[2])]
    else:
        assert h.sched.num_preemptions == 0 and other.seqs[0].status is SequenceStatus.RUNNING
        assert child.status is SequenceStatus.WAITING and child.num_computed_tokens == 0
        assert plan.copy_blocks == [] and child.seq_id not in plan.num_scheduled_tokens
    assert parent.num_output_tokens == 1
    h.run()
    assert all(s.num_output_tokens == 3 for s in (*r.seqs, *other.seqs))


def test_n_gt_1_with_a_tiny_pool_and_preemption() -> None:
    h = Harness(make_scheduler(num_blocks=7, max_num_batched_tokens=6, max_model_len=24), seed=1, stop_prob=0.05)
    rs = [h.add(make_request(list(range(10, 19 + i)), n=3, max_tokens=10)) for i in range(3)]
    h.run()
    assert h.sched.num_preemptions > 0
    assert all(len(r.seqs) == 3 and r.finished for r in rs)


# ---- prefix cache through the scheduler ------------------------------------------------------------------------------
def test_cache_salt_isolates_prefixes_and_num_cached_tokens_is_reported() -> None:
    h = Harness(make_scheduler())
    prompt = list(range(10, 20))
    first = h.add(make_request(prompt, cache_salt="alice", max_tokens=1))
    h.run()
    same = h.add(make_request(prompt, cache_salt="alice", max_tokens=1))
    other = h.add(make_request(prompt, cache_salt="bob", max_tokens=1))
    unsalted = h.add(make_request(prompt, max_tokens=1))
    h.run()
    assert first.seqs[0].num_cached_tokens == 0
    assert same.seqs[0].num_cached_tokens == 8  # two full blocks; the third is partial
    assert other.seqs[0].num_cached_tokens == 0 and unsalted.seqs[0].num_cached_tokens == 0


def test_num_cached_tokens_reaches_the_engine_outputs() -> None:
    sched_config = EngineConfig(num_kv_blocks=32, block_size=4)
    worker = Worker(32, 4)
    core = EngineCore(sched_config, worker, max_model_len=64, num_blocks=32)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    core.add_request(make_request(prompt, request_id="a", max_tokens=2))
    outs = core.step()
    assert [(o.request_id, o.num_cached_tokens) for o in outs] == [("a", 0)]
    core.add_request(make_request(prompt, request_id="b", max_tokens=2))
    outs = core.step()
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 12}
    stats = core.stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 26


def test_prefix_cache_stats_count_each_admission_once() -> None:
    # b waits for blocks for several steps: its failed admission attempts must not count as lookups
    h = Harness(make_scheduler(num_blocks=6, max_model_len=64))
    h.add(make_request(list(range(10, 26)), max_tokens=2))
    h.add(make_request(list(range(10, 26)), max_tokens=1))
    h.run()
    assert h.sched.num_preemptions == 0 and len(h.plans) == 2
    stats = h.sched.kv.stats
    assert stats.queries == 32
    assert stats.hits == 12


def test_new_sequence_says_which_request_and_trace_it_is_for() -> None:
    sched = make_scheduler()
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    request = make_request([1, 2, 3], request_id="who")
    request.trace_context = {"traceparent": traceparent, "tracestate": "k=v"}
    sched.add_request(request)
    sched.add_request(make_request([4, 5], request_id="untraced"))
    new = {s.request_id: s for s in sched.schedule().new_seqs}
    assert new["who"].trace_context == traceparent and new["who"].trace_state == "k=v"
    assert new["untraced"].trace_context == "" and new["untraced"].trace_state == ""


def test_engine_core_abort_and_finish_return_their_outputs() -> None:
    core = EngineCore(EngineConfig(num_kv_blocks=32, block_size=4), Worker(32, 4), max_model_len=64, num_blocks=32)
    core.add_request(make_request([5, 6, 7], request_id="a", n=3, max_tokens=8))
    core.add_request(make_request([5, 6], request_id="b", max_tokens=8))
    core.step()  # a prefills its shared prompt part, b prefills and samples
    assert core.stats().num_requests == 2 and core.has_request("a")
    outs = core.finish_choice("b", 0, FinishReason.STOP_STRING, "\n")
    assert [(o.index, o.finish_reason, o.stop_reason) for o in outs] == [(0, FinishReason.STOP_STRING, "\n")]
    assert core.finish_choice("b", 0, FinishReason.STOP_STRING, "\n") == [] and not core.has_request("b")
    # a's siblings do not exist yet (it has not forked): the abort still ends all three choices
    outs = core.abort("a")
    assert sorted((o.index, o.finish_reason) for o in outs) == [(i, FinishReason.ABORT) for i in range(3)]
    assert core.abort("a") == [] and not core.has_request("a")
    stats = core.stats()
    assert stats.free_blocks == stats.total_blocks == 32 and stats.num_requests == stats.running == 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        core.check_request(3, 100_000)


def test_prefix_cache_evictions_reach_the_engine_stats() -> None:
    # a's four full prompt blocks stay cached after it ends; b's 31-token prompt needs all 8 blocks: four evictions
    core = EngineCore(EngineConfig(num_kv_blocks=8, block_size=4), Worker(8, 4), max_model_len=64, num_blocks=8)
    core.add_request(make_request(list(range(10, 26)), request_id="a", max_tokens=1))
    while core.has_unfinished:
        core.step()
    assert core.stats().prefix_cache_evictions == 0
    core.add_request(make_request(list(range(100, 131)), request_id="b", max_tokens=1))
    while core.has_unfinished:
        core.step()
    assert core.stats().prefix_cache_evictions == 4
