"""Property-based scheduler tests: random workloads against the invariants of tests/scheduler_sim.py.

`SchedulerMachine` interleaves add / step / abort / finish (stop string) with a "hog" that takes free blocks straight
from the pool to force preemption in tiny pools; after every action the block accounting, the free queue, the cache
map, the hash contents and the coverage of every running sequence are checked, and every step runs the worker
simulation, which must agree with the scheduler. At the end everything must finish and the pool must be whole.
`test_outputs_do_not_depend_on_scheduling` checks that preemption, chunking and caching never change what a request
generates when the "model" is a deterministic function of the tokens so far.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_core.core.request import FinishReason, Request, SequenceStatus
from engine_core.core.scheduler import Scheduler
from tests.scheduler_sim import (
    Harness,
    Workload,
    check_invariants,
    make_request,
    make_scheduler,
    model_token,
    prompts,
    request_outputs,
    workload_requests,
    workloads,
)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h: Harness
        self.live: list[Request] = []
        self.next_id = 0

    @property
    def sched(self) -> Scheduler:
        return self.h.sched

    @initialize(
        num_blocks=st.integers(3, 8),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(1, 16),
        max_num_seqs=st.integers(1, 5),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        max_model_len=st.integers(4, 32),
        seed=st.integers(0, 1000),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_num_seqs: int,
        policy: str,
        caching: bool,
        max_model_len: int,
        seed: int,
    ) -> None:
        # NOTE: max_model_len within the pool: a sequence that outgrows the whole KV cache can never run.
        sched = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            policy=policy,
            caching=caching,
            max_model_len=min(max_model_len, num_blocks * block_size),
        )
        self.h = Harness(sched, seed=seed, stop_prob=0.05)

    # ---- actions ----------------------------------------------------------------------------------------------------
    @rule(
        specs=st.lists(
            st.tuples(
                prompts(),
                st.integers(1, 3),  # n
                st.integers(0, 2),  # priority
                st.one_of(st.none(), st.integers(1, 16)),  # max_tokens
                st.sampled_from([None, None, "tenant"]),  # cache_salt
                st.sampled_from([None, None, None, 1]),  # prompt_logprobs (bypasses the prefix cache)
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, specs: list[tuple[list[int], int, int, int | None, str | None, int | None]]) -> None:
        for prompt, n, priority, max_tokens, salt, prompt_logprobs in specs:
            self.next_id += 1
            request = make_request(
                prompt,
                request_id=f"r{self.next_id}",
                n=n,
                max_tokens=max_tokens,
                priority=priority,
                cache_salt=salt,
                prompt_logprobs=prompt_logprobs,
            )
            if len(prompt) >= self.sched.max_model_len:
                with pytest.raises(ValueError, match=f"{len(prompt)}.*{self.sched.max_model_len}"):
                    self.sched.add_request(request)
            elif n > self.sched.config.max_num_seqs:
                with pytest.raises(ValueError, match="max_num_seqs"):
                    self.sched.add_request(request)
            else:
                self.h.add(request)
                self.live.append(request)

    @rule(steps=st.integers(1, 6), abort_mid_step=st.integers(0, 5), which=st.integers(0, 100))
    def step(self, steps: int, abort_mid_step: int, which: int) -> None:
        def abort() -> None:
            if abort_mid_step == 0 and self.live:
                self.sched.abort_request(self.live[which % len(self.live)].request_id)

        for i in range(steps):
            if i and not self.sched.has_unfinished:
                break
            preemptions = self.sched.num_preemptions
            plan = self.h.step(before_update=abort if i == 0 else None)
            self._prune()
            # coverage, visible with --hypothesis-show-statistics
            if self.sched.num_preemptions > preemptions:
                event("preemption")
            if plan.copy_blocks:
                event("copy-on-write")
            if any(new.num_computed_tokens for new in plan.new_seqs):
                event("resumed with computed tokens (prefix hit or fork)")

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 100))
    def abort(self, which: int) -> None:
        request = self.live[which % len(self.live)]
        assert self.sched.abort_request(request.request_id) is request
        assert request.finished and all(s.finish_reason is not None for s in request.seqs)
        assert self.sched.abort_request(request.request_id) is None
        self._prune()

    @precondition(lambda self: any(not s.is_finished for r in self.live for s in r.seqs))
    @rule(which=st.integers(0, 100))
    def finish_stop_string(self, which: int) -> None:
        seqs = [s for r in self.live for s in r.seqs if not s.is_finished]
        seq = seqs[which % len(seqs)]
        self.sched.finish_seq(seq, FinishReason.STOP_STRING, "stop")
        assert seq.status is SequenceStatus.FINISHED and seq.seq_id not in self.sched.kv.tables
        self._prune()

    @rule(k=st.integers(1, 4))
    def hog(self, k: int) -> None:
        """Takes up to k free blocks away from the scheduler (forces preemption in a tiny pool)."""
        self.h.held += self.sched.kv.pool.allocate(min(k, self.sched.kv.num_free_blocks))

    @precondition(lambda self: self.h.held)
    @rule()
    def release(self) -> None:
        self.sched.kv.pool.free(reversed(self.h.held))
        self.h.held = []

    # ---- checks ---------------------------------------------------------------------------------------------------
    def _prune(self) -> None:
        self.live = [r for r in self.live if not r.finished]

    def release_and_run(self) -> None:
        if self.h.held:
            self.release()
        self.h.run(max_steps=3000)
        self._prune()
        assert self.live == []
        assert self.sched.kv.num_free_blocks == self.sched.kv.pool.num_blocks
        assert self.sched.requests == {} and self.sched.seqs == {}

    @invariant()
    def invariants(self) -> None:
        check_invariants(self.sched, self.h.held)
        for request in self.live:
            assert self.sched.requests.get(request.request_id) is request

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.release_and_run()


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSchedulerMachine = SchedulerMachine.TestCase


# ---- outputs are independent of scheduling --------------------------------------------------------------------------
def run_workload(sched: Scheduler, workload: Workload) -> tuple[dict, int]:
    """Runs every request to completion with `model_token` as the model."""
    h = Harness(sched)
    h.worker.sample = lambda seq_id: model_token(h.worker.seqs[seq_id].token_ids, sched.seqs[seq_id].index)
    requests = [h.add(r) for r in workload_requests(workload, max_prompt=20)]
    h.run(max_steps=5000)
    return request_outputs(requests), sched.num_preemptions


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    workload=workloads(min_max_tokens=4, min_size=2),
    num_blocks=st.integers(6, 10),
    budget=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_outputs_do_not_depend_on_scheduling(workload: Workload, num_blocks: int, budget: int, policy: str) -> None:
    roomy, preemptions = run_workload(make_scheduler(num_blocks=256, max_model_len=24), workload)
    assert preemptions == 0
    tight, _ = run_workload(
        make_scheduler(
            num_blocks=num_blocks,
            block_size=4,
            max_num_batched_tokens=budget,
            max_num_seqs=3,
            policy=policy,
            max_model_len=24,
        ),
        workload,
    )
    assert tight == roomy
