"""EngineCore.readmit (the services' failover): requests running on a core whose executor failed mid-step move to a
fresh core and finish with exactly the tokens, finishes and prompt logprobs of an undisturbed run, none repeated and
none lost. Real engines on the tiny random Llama of tests/conftest.py; the fault is a real exception out of a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput
from engine_core.engine import EngineCore
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output.params import StructuredOutputsParams
from engine_core.worker.model_runner import ModelRunner
from tests.threaded_runner import ThreadedRunner

BLOCKS = 64
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


class WorkerDied(RuntimeError):
    pass


class FailingRunner:
    """The real runner until its `fail_at`-th step that runs tokens, which raises (a worker lost mid-step: no result
    ever arrives). NOTE: empty steps (a grammar still compiling) do not count: how many of those pass depends on the
    compile's time, and the fault must land mid-output."""

    def __init__(self, runner: ModelRunner, fail_at: int) -> None:
        self.runner = runner
        self.fail_at = fail_at
        self.steps = 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += not plan.is_empty
        if self.steps >= self.fail_at:
            raise WorkerDied(f"step {self.steps}")
        return self.runner.execute(plan)


def make_core(tiny_dir: Path, fail_at: int | None, pipelined: bool, spec: dict | None) -> EngineCore:
    config = EngineConfig(
        model=str(tiny_dir), block_size=4, num_kv_blocks=BLOCKS, max_num_seqs=8, attention_backend="cpu",
        async_scheduling=pipelined, speculative_config=spec, max_num_batched_tokens=16,
    )  # fmt: skip
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(BLOCKS)
    inner = FailingRunner(runner, fail_at) if fail_at is not None else runner
    executor = ThreadedRunner(inner) if pipelined else inner  # type: ignore[arg-type]
    return EngineCore(config, executor, runner.max_model_len, BLOCKS)


def requests() -> list[Request]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [
        Request("greedy", [5, 6, 7, 8] * 4, greedy),
        Request("seeded", [3, 17, 5, 99, 42], SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True)),
        Request("n2", [1, 2, 3, 1, 2, 3], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)),
        Request(
            "plp", [9, 8, 7, 6, 5, 4, 3, 2, 1, 9], SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2)
        ),
        Request(
            "beam", [4, 4, 2, 1], SamplingParams(use_beam_search=True, beam_width=2, max_tokens=5, temperature=0.0)
        ),
    ]


Result = dict[tuple[str, int], tuple[list[int], FinishReason | None]]


def collect(outputs: list[SeqOutput], result: Result, prompt_lps: dict[str, list[int]]) -> None:
    for out in outputs:
        tokens, reason = result.get((out.request_id, out.index), ([], None))
        assert reason is None, f"{out.request_id}/{out.index} reported after it finished"
        result[(out.request_id, out.index)] = (tokens + out.new_token_ids, out.finish_reason)
        if out.prompt_logprobs:
            start = out.prompt_logprobs_start
            prompt_lps.setdefault(out.request_id, []).extend(range(start, start + len(out.prompt_logprobs)))


def run(core: EngineCore, result: Result, prompt_lps: dict[str, list[int]]) -> None:
    while core.has_unfinished:
        collect(core.step(), result, prompt_lps)


@pytest.fixture(scope="module")
def undisturbed(tiny_dir: Path) -> tuple[Result, dict[str, list[int]]]:
    core = make_core(tiny_dir, None, pipelined=False, spec=None)
    for request in requests():
        core.add_request(request)
    result: Result = {}
    prompt_lps: dict[str, list[int]] = {}
    run(core, result, prompt_lps)
    return result, prompt_lps


@pytest.mark.parametrize(
    ("fail_at", "pipelined", "spec"),
    [(1, False, None), (2, False, None), (5, False, None), (9, True, None), (4, False, NGRAM), (7, True, NGRAM)],
)
def test_requests_resume_on_a_fresh_core_token_for_token(
    tiny_dir: Path, undisturbed: tuple[Result, dict[str, list[int]]], fail_at: int, pipelined: bool, spec: dict | None
) -> None:
    expected, expected_lps = undisturbed
    failing = make_core(tiny_dir, fail_at, pipelined, spec)
    reqs = requests()
    for request in reqs:
        failing.add_request(request)
    result: Result = {}
    prompt_lps: dict[str, list[int]] = {}
    with pytest.raises(WorkerDied):
        run(failing, result, prompt_lps)
    fresh = make_core(tiny_dir, None, pipelined, spec)
    moved = [r for r in reqs if failing.has_request(r.request_id)]
    assert moved, "the fault came after every request finished"
    for request in moved:
        fresh.readmit(request)
    run(fresh, result, prompt_lps)
    assert result == expected
    assert prompt_lps == expected_lps  # every prompt position once, in order
    stats = fresh.stats()
    assert stats.num_requests == 0 and stats.free_blocks == stats.total_blocks


def test_readmit_refuses_an_id_in_use(tiny_dir: Path) -> None:
    core = make_core(tiny_dir, None, pipelined=False, spec=None)
    request = Request("dup", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    core.add_request(request)
    with pytest.raises(ValueError, match="already in use"):
        core.readmit(Request("dup", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4)))


@pytest.mark.parametrize("fail_at", [4, 8])
def test_structured_output_resumes_with_its_matcher_replayed(tiny_vocab_dir: Path, fail_at: int) -> None:
    """A grammar-constrained sampled request (n=2) moved mid-output: the worker's matcher replays the tokens it had,
    so the resumed choices stay in the grammar and equal the undisturbed ones."""

    def request() -> Request:
        so = StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{4,8}")
        params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, structured_outputs=so)
        return Request("so", [1, 28, 314, 15], params)

    expected: Result = {}
    core = make_core(tiny_vocab_dir, None, pipelined=False, spec=None)
    core.add_request(request())
    run(core, expected, {})
    failing = make_core(tiny_vocab_dir, fail_at, pipelined=False, spec=None)
    moved = request()
    failing.add_request(moved)
    result: Result = {}
    with pytest.raises(WorkerDied):
        run(failing, result, {})
    assert any(tokens for tokens, _ in result.values()), "the fault came before any output"
    fresh = make_core(tiny_vocab_dir, None, pipelined=False, spec=None)
    fresh.readmit(moved)
    run(fresh, result, {})
    assert result == expected
