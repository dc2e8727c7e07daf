"""A model-free worker for scheduler tests: it runs plans from their deltas alone and checks every forward.

`Worker` executes each plan from its deltas alone (new sequences in full, then only new block ids and counts,
`finished_seq_ids` dropped, `copy_blocks` applied) and keeps a fake KV cache that stores the token id written to every
slot. Every forward checks that the slots a sequence attends over hold its own tokens, so a wrong prefix hit, a shared
block written twice or a missing copy-on-write shows up as wrong "K/V". `Harness.step` also checks that the worker's
view (tables, computed counts, tokens) equals the scheduler's and that the two agree on who samples.

Also the workloads the property tests draw (`prompts`, `workloads`) and the test "model" (`model_token`) that makes a
sequence's tokens depend only on its tokens so far, so that outputs can be compared across schedules.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from hypothesis import strategies as st

from engine_core.config import EngineConfig
from engine_core.core.block_pool import KVBlock
from engine_core.core.prefix_cache import extend_block_hashes
from engine_core.core.request import FinishReason, Request, SequenceStatus
from engine_core.core.scheduler import Scheduler
from engine_core.core.step_results import SequenceUpdate
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.sampling_params import SamplingParams

EOS = 2
STOP = 3  # an explicit stop_token_id
_request_ids = itertools.count()


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    max_model_len: int = 128,
    caching: bool = True,
) -> Scheduler:
    config = EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, max_model_len, num_blocks)


def make_request(
    prompt: list[int],
    *,
    request_id: str | None = None,
    n: int = 1,
    max_tokens: int | None = 8,
    priority: int = 0,
    cache_salt: str | None = None,
    **params: object,
) -> Request:
    sp = SamplingParams(n=n, max_tokens=max_tokens, eos_token_id=EOS, stop_token_ids=[STOP], **params)  # type: ignore[arg-type]
    rid = request_id if request_id is not None else f"req-{next(_request_ids)}"
    return Request(rid, list(prompt), sp, priority=priority, cache_salt=cache_salt)


# ---- the worker simulation ----------------------------------------------------------------------------------------
@dataclass
class WorkerSeq:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed: int


class Worker:
    """A worker that knows only what the plans tell it, with a fake KV cache of token ids per slot."""

    def __init__(self, num_blocks: int, block_size: int, sample: Callable[[int], int] | None = None) -> None:
        self.block_size = block_size
        self.seqs: dict[int, WorkerSeq] = {}
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.sample = sample or (lambda seq_id: 10 + seq_id % 7)

    def apply(self, plan: SchedulerOutput) -> None:
        for seq_id in plan.finished_seq_ids:
            assert seq_id in self.seqs, f"told to drop {seq_id}, which it never got"
            del self.seqs[seq_id]
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"sequence {new.seq_id} sent in full twice"
            assert len(new.block_ids) * self.block_size >= new.num_computed_tokens
            self.seqs[new.seq_id] = WorkerSeq(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.num_computed_tokens
            )
        for cached in plan.cached_seqs:
            ws = self.seqs[cached.seq_id]
            assert ws.num_computed == cached.num_computed_tokens
            ws.block_ids += cached.new_block_ids
        sources = [list(self.kv[src]) for src, _ in plan.copy_blocks]  # all reads before any write
        for (_, dst), content in zip(plan.copy_blocks, sources, strict=True):
            self.kv[dst] = content
        listed = [s.seq_id for s in plan.new_seqs] + [s.seq_id for s in plan.cached_seqs]
        assert sorted(listed) == sorted(plan.num_scheduled_tokens), "every scheduled sequence is described once"
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())

    def forward(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        written: set[tuple[int, int]] = set()
        for seq_id, n in plan.num_scheduled_tokens.items():
            ws = self.seqs[seq_id]
            end = ws.num_computed + n
            assert n > 0 and end <= len(ws.token_ids), "scheduled a token the worker does not know"
            assert len(ws.block_ids) * bs >= end, "no slot for a scheduled token"
            for pos in range(ws.num_computed, end):
                slot = (ws.block_ids[pos // bs], pos % bs)
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[slot[0]][slot[1]] = ws.token_ids[pos]
        out = ModelRunnerOutput()
        for seq_id, n in plan.num_scheduled_tokens.items():
            ws = self.seqs[seq_id]
            ws.num_computed += n
            # attention reads every slot up to the last computed token: it must hold this sequence's tokens
            seen = [self.kv[ws.block_ids[p // bs]][p % bs] for p in range(ws.num_computed)]
            assert seen == ws.token_ids[: ws.num_computed], f"sequence {seq_id} attends over foreign K/V"
            if ws.num_computed == len(ws.token_ids):
                token = self.sample(seq_id)
                ws.token_ids.append(token)
                out.seq_ids.append(seq_id)
                out.sampled_token_ids.append(token)
        return out

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:  # the EngineCore executor protocol
        self.apply(plan)
        return self.forward(plan)


def check_agreement(sched: Scheduler, worker: Worker, plan: SchedulerOutput) -> None:
    """After the deltas: every sequence the worker holds is running and looks the same on both sides."""
    for seq_id, ws in worker.seqs.items():
        seq = sched.seqs.get(seq_id)
        assert seq is not None and seq.status is SequenceStatus.RUNNING, f"worker holds dead sequence {seq_id}"
        assert ws.block_ids == sched.kv.block_ids(seq_id)
        assert ws.num_computed == seq.num_computed_tokens - plan.num_scheduled_tokens.get(seq_id, 0)
        assert ws.token_ids == seq.token_ids
    for seq_id in plan.num_scheduled_tokens:
        assert seq_id in worker.seqs, f"scheduled sequence {seq_id} is unknown to the worker"


def check_invariants(sched: Scheduler, held: Collection[KVBlock] = ()) -> None:
    """Block accounting, free queue, cache map, hash contents and per-sequence coverage. `held`: blocks taken
    straight from the pool by a test (one entry per reference)."""
    kv, pool, bs = sched.kv, sched.kv.pool, sched.block_size
    refs = Counter(b.block_id for table in kv.tables.values() for b in table)
    refs.update(b.block_id for b in held)
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs[block.block_id], f"{block}: {refs[block.block_id]} holders"
    queue = [b.block_id for b in pool.free_queue]
    assert len(queue) == len(set(queue)) == pool.num_free, "a block is in the free queue twice"
    assert set(queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for key, block in pool.cached.items():
        assert block.block_hash == key
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached.get(block.block_hash) is block
    # sequences: states, tables, hashes
    running, waiting = sched.running, sched.waiting
    assert not {s.seq_id for s in running} & {s.seq_id for s in waiting}
    assert set(kv.tables) == {s.seq_id for s in running}
    assert sum(s.request.sampling_params.n if s.pending_fork else 1 for s in running) <= sched.config.max_num_seqs
    for seq in waiting:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    for seq in running:
        assert seq.status is SequenceStatus.RUNNING
        assert 0 < seq.num_computed_tokens <= seq.target_tokens
        assert seq.num_tokens < sched.max_model_len
        table = kv.tables[seq.seq_id]
        assert len(table) == -(-seq.num_computed_tokens // bs), "table does not match the computed tokens"
        hashes = extend_block_hashes([], seq.token_ids, bs, seq.request.cache_salt)
        for i, block in enumerate(table):
            if block.block_hash is not None:
                assert (i + 1) * bs <= seq.num_computed_tokens, "an uncomputed block is in the prefix cache"
                assert block.block_hash == hashes[i], "a cached block's hash does not match its holder's tokens"
    for seq in running + waiting:
        assert sched.requests.get(seq.request.request_id) is seq.request
        assert sched.seqs.get(seq.seq_id) is seq
    for request in sched.requests.values():
        assert not all(s.is_finished for s in request.seqs), f"finished request {request.request_id} still tracked"
    if not sched.has_unfinished:
        assert pool.num_free == pool.num_blocks - len(set(b.block_id for b in held)), "blocks leaked"
        assert sched.requests == {} and sched.seqs == {}


class Harness:
    """Drives the scheduler and the worker simulation step by step, checking everything after each step."""

    def __init__(self, sched: Scheduler, seed: int = 0, stop_prob: float = 0.0) -> None:
        self.sched = sched
        self.rng = random.Random(seed)
        self.stop_prob = stop_prob
        self.worker = Worker(sched.kv.pool.num_blocks, sched.block_size, self._sample)
        self.plans: list[SchedulerOutput] = []
        self.updates: list[SequenceUpdate] = []
        self.held: list[KVBlock] = []  # blocks a test took straight from the pool

    def _sample(self, seq_id: int) -> int:
        return EOS if self.rng.random() < self.stop_prob else self.rng.randrange(10, 40)

    def add(self, request: Request) -> Request:
        self.sched.add_request(request)
        check_invariants(self.sched, self.held)
        return request

    def step(self, before_update: Callable[[], object] | None = None) -> SchedulerOutput:
        sched = self.sched
        plan = sched.schedule()
        assert plan.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        self.worker.apply(plan)
        check_agreement(sched, self.worker, plan)
        out = self.worker.forward(plan)
        expected = [
            s for s in plan.num_scheduled_tokens if sched.seqs[s].num_computed_tokens == sched.seqs[s].num_tokens
        ]
        assert out.seq_ids == expected, "worker and scheduler disagree on which sequences sample"
        if before_update is not None:
            before_update()
        self.updates = sched.update(out)
        for upd in self.updates:
            if not upd.seq.is_finished:
                assert self.worker.seqs[upd.seq.seq_id].token_ids == upd.seq.token_ids
        self.plans.append(plan)
        check_invariants(sched, self.held)
        return plan

    def run(self, max_steps: int = 1000) -> int:
        for steps in range(max_steps):
            if not self.sched.has_unfinished:
                return steps
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps (livelock?)")


def first_step_of(harness: Harness) -> dict[int, int]:
    """seq_id -> the step in which the worker first got it."""
    seen: dict[int, int] = {}
    for i, plan in enumerate(harness.plans):
        for new in plan.new_seqs:
            seen.setdefault(new.seq_id, i)
    return seen


# ---- workloads and the test model -----------------------------------------------------------------------------------
# Prompts are cut from a few shared bases so that prefixes (and prefix-cache hits) are common.
BASES = [list(range(10, 42)), [7, 8] * 16, list(range(41, 9, -1))]


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    base = draw(st.sampled_from(BASES))
    prompt = base[: draw(st.integers(0, 20))] + draw(st.lists(st.integers(10, 14), max_size=5))
    return prompt or [11]


Workload = list[tuple[list[int], int, int, int]]  # per request: prompt, n, max_tokens, priority


def workloads(min_max_tokens: int, min_size: int) -> st.SearchStrategy[Workload]:
    return st.lists(
        st.tuples(prompts(), st.integers(1, 3), st.integers(min_max_tokens, 16), st.integers(0, 2)),
        min_size=min_size,
        max_size=6,
    )


def workload_requests(workload: Workload, max_prompt: int) -> list[Request]:
    return [
        make_request(prompt[:max_prompt], request_id=f"w{i}", n=n, max_tokens=max_tokens, priority=priority)
        for i, (prompt, n, max_tokens, priority) in enumerate(workload)
    ]


def model_token(tokens: list[int], index: int) -> int:
    """The test "model": the next token of choice `index` depends only on the tokens so far (EOS now and then)."""
    token = random.Random(f"{tokens}/{index}").randrange(10, 30)
    return EOS if token == 29 else token


def request_outputs(requests: list[Request]) -> dict[str, list[tuple[int, tuple[int, ...], FinishReason | None]]]:
    return {r.request_id: sorted((s.index, tuple(s.token_ids), s.finish_reason) for s in r.seqs) for r in requests}
