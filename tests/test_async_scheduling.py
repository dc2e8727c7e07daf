"""Async scheduling: EngineCore plans and submits step N+1 while step N runs (`Scheduler.schedule_ahead`).

`InOrderWorker` puts tests/scheduler_sim.py's worker simulation behind `submit`: steps run in the order they were
sent, each as late as a real worker could run it (when its result, or a later one's, is asked for). So a block that
was freed and reused while a step was in flight, or a token scheduled before the worker knows it, shows up as
foreign K/V or an unknown token. The last test runs the real ModelRunner on its own thread.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.engine import PIPELINE_MAX_STEP_S, EngineCore
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.worker.model_runner import ModelRunner
from tests.scheduler_sim import (
    Worker,
    Workload,
    check_invariants,
    make_request,
    model_token,
    prompts,
    request_outputs,
    workload_requests,
    workloads,
)
from tests.threaded_runner import ThreadedRunner

MAX_LEN = 24  # max_model_len of every core here


class InOrderWorker:
    """A PipelinedExecutor over the worker simulation; records how many steps were in flight at once. Its clock
    advances by `step_s` per step run (the core's clock in these tests: real time would make pipelining depend on
    the machine's load)."""

    def __init__(self, worker: Worker, step_s: float = 0.001) -> None:
        self.worker = worker
        self.step_s = step_s
        self.now = 0.0
        self.sent: list[SchedulerOutput] = []
        self.results: list[ModelRunnerOutput] = []
        self.max_in_flight = 0
        self.sent_ahead = 0  # steps sent while another was in flight

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit(plan).result()

    def submit(self, plan: SchedulerOutput) -> _Step:
        in_flight = len(self.sent) - len(self.results)
        self.sent_ahead += in_flight > 0
        self.max_in_flight = max(self.max_in_flight, in_flight + 1)
        self.sent.append(plan)
        return _Step(self, len(self.sent) - 1)

    def run_until(self, index: int) -> ModelRunnerOutput:
        while len(self.results) <= index:
            self.results.append(self.worker.execute(self.sent[len(self.results)]))
            self.now += self.step_s
            for seq_id, ws in self.worker.seqs.items():
                # NOTE: a real worker's batch holds MAX_LEN positions: a step planned ahead must not pass them.
                assert ws.num_computed < MAX_LEN, f"sequence {seq_id} computed past max_model_len"
        return self.results[index]


class _Step:
    def __init__(self, worker: InOrderWorker, index: int) -> None:
        self.worker, self.index = worker, index

    def result(self) -> ModelRunnerOutput:
        return self.worker.run_until(self.index)


def make_core(
    *,
    pipelined: bool,
    num_blocks: int = 64,
    budget: int = 256,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    step_s: float = 0.001,
) -> tuple[EngineCore, InOrderWorker]:
    config = EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        scheduling_policy=policy,
        async_scheduling=pipelined,
    )
    worker = InOrderWorker(Worker(num_blocks, 4), step_s)
    core = EngineCore(config, worker, max_model_len=MAX_LEN, num_blocks=num_blocks, clock=lambda: worker.now)
    index_of: dict[int, int] = {}  # seq_id -> choice index, kept after the scheduler forgets a finished sequence

    def sample(seq_id: int) -> int:
        seq = core.scheduler.seqs.get(seq_id)
        if seq is not None:
            index_of[seq_id] = seq.index
        return model_token(worker.worker.seqs[seq_id].token_ids, index_of.get(seq_id, -1))

    worker.worker.sample = sample
    return core, worker


def run(core: EngineCore, requests: list[Request], actions: dict[int, tuple[str, int]] | None = None) -> int:
    """Steps until everything finished, checking the scheduler after every step; `actions`: step -> (abort |
    finish, request index) applied before that step, as the scheduler service applies commands. Returns steps."""
    for request in requests:
        core.add_request(request)
    for steps in range(3000):
        if not core.has_unfinished:
            return steps
        kind, which = (actions or {}).get(steps, ("", 0))
        if kind == "abort":
            core.abort(requests[which % len(requests)].request_id)
        elif kind == "finish":
            core.finish_choice(requests[which % len(requests)].request_id, 0, FinishReason.STOP_STRING, "stop")
        core.step()
        check_invariants(core.scheduler)
    raise AssertionError("not finished after 3000 steps")


def test_decode_steps_are_sent_while_the_previous_one_runs() -> None:
    core, worker = make_core(pipelined=True)
    request = make_request([5, 6, 7], max_tokens=8, ignore_eos=True)
    steps = run(core, [request])
    seq = request.seqs[0]
    assert seq.num_output_tokens == 8 and seq.finish_reason is FinishReason.LENGTH
    # The prefill and 7 decodes; every decode after the first (sent once a step had been timed) was sent while the
    # step before it ran; the step that samples the 8th token is known to finish the request by length, so nothing
    # is sent after it.
    assert len(worker.sent) == 8 and worker.sent_ahead == 6 and worker.max_in_flight == 2
    assert steps == 8
    assert core.scheduler.kv.pool.num_free == 64


def test_no_step_is_planned_ahead_of_long_steps() -> None:
    """Behind steps longer than PIPELINE_MAX_STEP_S a request that arrives between two of them is in the next step
    the workers run; behind short steps it waits for the one planned ahead (the hop saved is worth it there)."""
    for step_s, ahead in ((PIPELINE_MAX_STEP_S * 2, False), (PIPELINE_MAX_STEP_S / 2, True)):
        core, worker = make_core(pipelined=True, step_s=step_s)
        core.add_request(make_request([5, 6, 7], max_tokens=12, ignore_eos=True))
        returned = 4  # steps whose outputs the core has returned when the late request arrives
        for _ in range(returned):
            core.step()
        assert (worker.sent_ahead > 0) is ahead
        late = make_request([8, 9, 10], max_tokens=2, ignore_eos=True)
        core.add_request(late)  # between steps, as the scheduler service adds requests
        core.step()
        seq_id = late.seqs[0].seq_id
        first = next(i for i, plan in enumerate(worker.sent) if seq_id in plan.num_scheduled_tokens)
        assert first - returned == (1 if ahead else 0)  # steps the workers run after its arrival before it is in one
        run(core, [])
        assert late.seqs[0].num_output_tokens == 2


def test_a_parent_forks_as_soon_as_its_prompt_is_computed() -> None:
    """A fork needs the scheduler's own step (no plan ahead while a parent waits), and pipelining resumes after."""
    core, worker = make_core(pipelined=True)
    long = make_request([5, 6, 7], max_tokens=12, ignore_eos=True)
    pair = make_request([8, 9, 10, 11, 12], n=2, max_tokens=4, ignore_eos=True)
    core.add_request(long)
    core.add_request(pair)
    core.step()  # both prefills; the parent stops one prompt token short
    core.step()  # the fork, planned after that step's results
    assert [s.index for s in pair.seqs] == [0, 1]
    run(core, [])
    assert [s.num_output_tokens for s in pair.seqs] == [4, 4] and long.seqs[0].num_output_tokens == 12
    assert worker.sent_ahead >= 8


def test_a_sequence_that_reaches_max_model_len_is_not_planned_past_it() -> None:
    core, worker = make_core(pipelined=True)
    request = make_request(list(range(10, 20)), max_tokens=None, ignore_eos=True)
    run(core, [request])
    assert request.seqs[0].num_tokens == MAX_LEN and request.seqs[0].finish_reason is FinishReason.LENGTH
    assert len(worker.sent) == MAX_LEN - 10  # no step after the one whose token reaches the limit


def test_a_stop_token_costs_one_step_whose_result_is_dropped() -> None:
    core, worker = make_core(pipelined=True)
    sync_core, sync_worker = make_core(pipelined=False)
    prompt = next(p for p in ([i, i + 1] for i in range(10, 400)) if _stops_early(p))
    request, twin = make_request(prompt, max_tokens=16), make_request(prompt, max_tokens=16)
    run(core, [request])
    run(sync_core, [twin])
    assert request.seqs[0].finish_reason is FinishReason.STOP_TOKEN
    assert request.seqs[0].token_ids == twin.seqs[0].token_ids
    assert len(worker.sent) == len(sync_worker.sent) + 1  # the step planned before the stop was seen
    assert core.scheduler.kv.pool.num_free == 64


def _stops_early(prompt: list[int]) -> bool:
    """Whether the simulated model samples EOS within 16 tokens of this prompt."""
    core, _ = make_core(pipelined=False)
    request = make_request(prompt, max_tokens=16)
    run(core, [request])
    return request.seqs[0].finish_reason is FinishReason.STOP_TOKEN


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    workload=workloads(min_max_tokens=1, min_size=1),
    num_blocks=st.integers(6, 24),
    budget=st.integers(1, 12),
    max_num_seqs=st.integers(3, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_outputs_are_those_of_synchronous_steps(
    workload: Workload, num_blocks: int, budget: int, max_num_seqs: int, policy: str
) -> None:
    """Chunked prefill, forks (n > 1), preemption in tight pools, prefix hits, stops by token and length: the same
    tokens and finish reasons with steps planned ahead as without."""
    results = []
    for pipelined in (False, True):
        core, worker = make_core(
            pipelined=pipelined, num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, policy=policy
        )
        requests = workload_requests(workload, max_prompt=16)
        run(core, requests)
        assert core.scheduler.kv.pool.num_free == num_blocks
        assert worker.max_in_flight <= 2
        results.append(request_outputs(requests))
    assert results[0] == results[1]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    workload=st.lists(st.tuples(prompts(), st.integers(1, 2), st.integers(1, 12)), min_size=1, max_size=5),
    actions=st.dictionaries(
        st.integers(0, 30), st.tuples(st.sampled_from(["abort", "finish"]), st.integers(0, 10)), max_size=6
    ),
    num_blocks=st.integers(6, 16),
    budget=st.integers(1, 8),
)
def test_aborts_and_stop_strings_while_a_step_is_in_flight(
    workload: list[tuple[list[int], int, int]], actions: dict[int, tuple[str, int]], num_blocks: int, budget: int
) -> None:
    """A sequence ended between steps may still be in the step in flight: its blocks go back at once and may be
    reused by the next step (which the worker runs after it), and its late result is dropped."""
    core, _ = make_core(pipelined=True, num_blocks=num_blocks, budget=budget, max_num_seqs=3)
    requests = [
        make_request(prompt[:16], request_id=f"a{i}", n=n, max_tokens=max_tokens)
        for i, (prompt, n, max_tokens) in enumerate(workload)
    ]
    run(core, requests, actions)
    assert core.scheduler.kv.pool.num_free == num_blocks
    assert all(s.is_finished for r in requests for s in r.seqs)
    assert core.scheduler.requests == {} and core.scheduler.seqs == {}


def test_the_model_runner_gives_the_same_tokens_with_steps_planned_ahead(tiny_dir: Path) -> None:
    """Greedy, seeded sampling with logprobs, n = 2 and stop tokens on a tiny Llama: identical outputs."""
    results = []
    for pipelined in (False, True):
        config = EngineConfig(
            model=str(tiny_dir), block_size=4, num_kv_blocks=48, max_num_seqs=6, max_num_batched_tokens=16,
            attention_backend="cpu", async_scheduling=pipelined,
        )  # fmt: skip
        runner = ModelRunner(config, str(tiny_dir))
        runner.init_kv_cache(48)
        executor = ThreadedRunner(runner)
        core = EngineCore(config, executor, max_model_len=64, num_blocks=48)
        params = [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=9, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[5, 17, 33, 60, 90]),
        ]
        requests = [Request(f"m{i}", [3 + i, 9, 27, 81 % 128, 11 * i % 128], p) for i, p in enumerate(params)]
        logprobs: list[tuple[str, int, list[float]]] = []
        for request in requests:
            core.add_request(request)
        while core.has_unfinished:
            for out in core.step():
                if out.new_logprobs is not None:
                    logprobs.extend((out.request_id, out.index, row.logprobs) for row in out.new_logprobs)
        executor.pool.shutdown()
        results.append((request_outputs(requests), logprobs))
    assert results[0] == results[1]
