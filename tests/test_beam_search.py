"""Beam search in the engine equals transformers' `generate(num_beams=k, do_sample=False)` token for token (a tiny
random Llama, float32), and its beams share KV blocks: forks copy only the partial block, pruned beams free theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_core.beam_search import BeamSearchParams, beam_request
from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput
from engine_core.engine import EngineCore
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.sampling_params import SamplingParams, with_eos
from engine_core.worker.model_runner import ModelRunner
from services.convert.outputs import seq_output_from_proto, seq_output_to_proto
from services.convert.plan import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from tests.hf_reference import hf_beams

BLOCKS = 256
MAX_MODEL_LEN = 64
PROMPTS = [[3, 9, 27, 81], [5, 7, 11, 13, 17, 19, 23], [100, 4, 4, 4, 4, 4, 4, 4, 4, 60]]


def make_core(tiny_dir: Path, blocks: int = BLOCKS, max_num_seqs: int = 16) -> EngineCore:
    config = EngineConfig(
        model=str(tiny_dir), block_size=4, num_kv_blocks=blocks, max_num_seqs=max_num_seqs, attention_backend="cpu"
    )
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(blocks)
    return EngineCore(config, runner, max_model_len=MAX_MODEL_LEN, num_blocks=blocks)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def engine_beams(
    core: EngineCore, prompts: list[list[int]], params: BeamSearchParams, eos: int | None
) -> list[list[list[int]]]:
    """Every prompt's returned hypotheses (generated tokens), best first; all prompts run in one batch."""
    for i, prompt in enumerate(prompts):
        request, group = beam_request(str(i), prompt, params, eos, 128, MAX_MODEL_LEN)
        core.add_request(request, group)
    outputs: list[SeqOutput] = []
    while core.has_unfinished:
        outputs += core.step()
    result: list[list[list[int]]] = [[] for _ in prompts]
    for out in sorted(outputs, key=lambda o: (int(o.request_id), o.index)):
        assert not out.error
        result[int(out.request_id)].append(out.new_token_ids)
    return result


# NOTE: 36 and 82 are tokens these prompts' beams reach within the budget, so hypotheses end on a stop token (and
# on the length limit); two stop tokens make transformers keep 3 x width candidates a step, as the engine must.
STOPS = [36, 82]


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (4, 0.0, "never"), (8, 2.0, True), (4, -1.0, False), (8, 1.5, "never"), (2, 1.0, True)],
)
def test_beams_equal_transformers_with_eos(
    tiny_dir: Path, hf_model: torch.nn.Module, width: int, length_penalty: float, early_stopping: bool | str
) -> None:
    core = make_core(tiny_dir)
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=12,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        n=width // 2 + 1,
        stop_token_ids=STOPS[1:],
    )
    ours = engine_beams(core, PROMPTS, params, STOPS[0])
    stopped = 0
    for prompt, beams in zip(PROMPTS, ours, strict=True):
        assert beams == hf_beams(hf_model, prompt, params, STOPS)
        stopped += sum(b[-1] in STOPS for b in beams)
    assert stopped > 0, "no hypothesis ended on a stop token: the test lost its point"
    assert core.stats().free_blocks == BLOCKS


@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_equal_transformers_without_eos(tiny_dir: Path, hf_model: torch.nn.Module, width: int) -> None:
    core = make_core(tiny_dir)
    params = BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True)
    ours = engine_beams(core, PROMPTS, params, eos=46)
    for prompt, beams in zip(PROMPTS, ours, strict=True):
        assert beams == hf_beams(hf_model, prompt, params, None)
        assert all(len(b) == 10 for b in beams)


def test_preempted_beams_recompute_to_the_same_result(tiny_dir: Path) -> None:
    """A pool far too small for three groups at once: beams are preempted (recompute) and forks fall back to
    recomputing, yet every group ends with the hypotheses it finds alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=12, stop_token_ids=STOPS[1:])
    roomy = engine_beams(make_core(tiny_dir), PROMPTS, params, STOPS[0])
    core = make_core(tiny_dir, blocks=22)
    assert engine_beams(core, PROMPTS, params, STOPS[0]) == roomy
    assert core.stats().preemptions > 0
    assert core.stats().free_blocks == 22


def test_beams_share_blocks_and_pruned_beams_free_theirs(tiny_dir: Path) -> None:
    core = make_core(tiny_dir)
    prompt = [7] * 21  # 5 full blocks of 4 and one partial: every beam shares them
    request, group = beam_request(
        "0", prompt, BeamSearchParams(beam_width=8, max_tokens=16, ignore_eos=True), 2, 128, 64
    )
    core.add_request(request, group)
    peak_shared = peak_unshared = peak_live = 0
    while core.has_unfinished:
        core.step()
        running = [s for s in core.scheduler.running if not s.is_finished]
        stats = core.stats()
        peak_live = max(peak_live, stats.beam_search_live_beams)
        assert stats.beam_search_requests == 1 and stats.beam_search_live_beams <= 8
        used = BLOCKS - stats.free_blocks
        # Without sharing each beam would hold a block table of its own.
        unshared = sum(-(-s.num_tokens // 4) for s in running)
        peak_shared, peak_unshared = max(peak_shared, used), max(peak_unshared, unshared)
        assert used <= unshared
    counts = request.timings.beam
    assert counts is not None and counts.width == 8 and counts.steps == 16
    assert counts.forked >= 7 and counts.pruned > 0 and group.peak_live == 8
    assert peak_shared < 0.6 * peak_unshared, (peak_shared, peak_unshared)
    stats = core.stats()
    assert stats.free_blocks == BLOCKS
    # the metrics' counters (pagoda:beam_search_*) are the span's counts, kept once the group is gone
    assert peak_live == 8 and stats.beam_search_live_beams == 0
    assert (stats.beam_search_requests, stats.beam_search_beams_forked, stats.beam_search_beams_pruned) == (
        1,
        counts.forked,
        counts.pruned,
    )


def test_abort_ends_the_group_and_frees_every_block(tiny_dir: Path) -> None:
    core = make_core(tiny_dir)
    params = BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True, n=2)
    request, group = beam_request("a", PROMPTS[1], params, 2, 128, 64)
    core.add_request(request, group)
    for _ in range(4):
        core.step()
    assert len([s for s in request.seqs if not s.is_finished]) == 4
    outputs = core.abort("a")
    assert sorted(o.index for o in outputs) == [0, 1]  # the n choices a client waits for
    assert all(o.finish_reason.value == "abort" for o in outputs)
    core.step()  # the worker forgets the rows
    assert core.stats().free_blocks == BLOCKS and not core.has_unfinished
    assert len(core.scheduler.beam_groups) == 0
    # the group is gone, its counts stay in the metrics' totals
    counts, stats = request.timings.beam, core.stats()
    assert counts is not None and counts.forked > 0
    assert (stats.beam_search_requests, stats.beam_search_beams_forked) == (1, counts.forked)
    assert stats.beam_search_live_beams == 0


def test_a_beam_search_that_cannot_fit_the_pool_is_refused_before_work(tiny_dir: Path) -> None:
    core = make_core(tiny_dir, blocks=40, max_num_seqs=8)
    params = BeamSearchParams(beam_width=8, max_tokens=40, ignore_eos=True)
    request, group = beam_request("big", PROMPTS[0], params, 2, 128, 64)
    with pytest.raises(ValueError, match=r"beam_width \(8\) x max_tokens \(40\) needs up to 81 KV blocks"):
        core.add_request(request, group)
    wide = BeamSearchParams(beam_width=16, max_tokens=4)
    request, group = beam_request("wide", PROMPTS[0], wide, 2, 128, 64)
    with pytest.raises(ValueError, match=r"beam_width \(16\) must be <= max_num_seqs \(8\)"):
        core.add_request(request, group)
    assert not core.has_unfinished


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 65}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n"),
        ({"beam_width": 2, "temperature": 0.7}, "temperature"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "early_stopping": 1}, "early_stopping"),
        ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_beam_search_params_name_the_field(kwargs: dict, field: str) -> None:
    kwargs = {"max_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=f"^{field} "):
        BeamSearchParams(**kwargs)


class ProtoHop:
    """The remote worker's hop without the network: every plan and result through their Protobuf forms."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.step = runner, 0

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.step += 1
        back = plan_from_proto(plan_to_proto(plan, epoch="e", step=self.step))
        assert back.beam_deltas == plan.beam_deltas
        return result_from_proto(result_to_proto(self.runner.execute(back)))


def test_beams_through_the_worker_protocol_are_the_same(tiny_dir: Path) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=12, stop_token_ids=STOPS[1:])
    local = engine_beams(make_core(tiny_dir), PROMPTS, params, STOPS[0])
    config = EngineConfig(model=str(tiny_dir), block_size=4, num_kv_blocks=BLOCKS, max_num_seqs=16)
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(BLOCKS)
    core = EngineCore(config, ProtoHop(runner), max_model_len=MAX_MODEL_LEN, num_blocks=BLOCKS)
    assert engine_beams(core, PROMPTS, params, STOPS[0]) == local
    out = SeqOutput("r", 0, [4, 5], finish_reason=FinishReason.LENGTH, cumulative_logprob=-1.5)
    assert seq_output_from_proto("r", seq_output_to_proto(out)) == out


def test_sampling_params_with_use_beam_search_run_the_same_search(tiny_dir: Path) -> None:
    """The services' path: SamplingParams(use_beam_search=True) through EngineCore.add_request alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=12, n=2, length_penalty=0.5, stop_token_ids=STOPS[1:])
    want = engine_beams(make_core(tiny_dir), PROMPTS[:2], params, STOPS[0])
    core = make_core(tiny_dir)
    sp = SamplingParams(
        n=2, use_beam_search=True, beam_width=4, temperature=0.0, max_tokens=12, length_penalty=0.5,
        stop_token_ids=STOPS[1:],
    )  # fmt: skip
    for i, prompt in enumerate(PROMPTS[:2]):
        core.add_request(Request(str(i), prompt, with_eos(sp, STOPS[0], 128)))
    outputs: list[SeqOutput] = []
    while core.has_unfinished:
        outputs += core.step()
    got = [[o.new_token_ids for o in sorted(outputs, key=lambda o: o.index) if o.request_id == str(i)] for i in (0, 1)]
    assert got == want
    assert all(o.cumulative_logprob is not None and o.cumulative_logprob < 0 for o in outputs)


def test_sampling_params_refuse_what_beam_search_does_not_use() -> None:
    base = {"use_beam_search": True, "n": 2, "temperature": 0.0}
    for field, value in (("top_p", 0.5), ("logprobs", 2), ("seed", 3), ("presence_penalty", 0.5)):
        with pytest.raises(ValueError, match=f"^{field} is not supported with beam search"):
            SamplingParams(**base, **{field: value})
    with pytest.raises(ValueError, match=r"^n must be an integer in \[1, beam_width \(2\)\]"):
        SamplingParams(**{**base, "n": 3}, beam_width=2)
    with pytest.raises(ValueError, match=r"^temperature must be 0 with beam search"):
        SamplingParams(use_beam_search=True, n=2)


def test_a_failing_beam_row_fails_its_search_alone(tiny_dir: Path) -> None:
    """A row that cannot be sampled ends its whole beam search with ERROR (choices 0..n-1 only, every block back);
    a beam search beside it is unaffected."""
    from tests.test_row_failures import MARK, FailingProcessor

    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True, n=2)
    want = engine_beams(make_core(tiny_dir), PROMPTS[:1], params, 2)
    core = make_core(tiny_dir)
    runner = core.executor
    assert isinstance(runner, ModelRunner)
    runner.sampling.processors.append(FailingProcessor(runner.info.vocab_size, runner.device, 16, "apply"))
    for rid, prompt in (("0", PROMPTS[0]), ("bad", [MARK, 4, 4])):
        request, group = beam_request(rid, prompt, params, 2, 128, MAX_MODEL_LEN)
        core.add_request(request, group)
    outputs: list[SeqOutput] = []
    while core.has_unfinished:
        outputs += core.step()
    bad = [o for o in outputs if o.request_id == "bad"]
    assert sorted(o.index for o in bad) == [0, 1] and all(o.finish_reason is FinishReason.ERROR for o in bad)
    assert any("grammar state is corrupt" in o.error for o in bad)
    assert [o.new_token_ids for o in sorted(outputs, key=lambda o: o.index) if o.request_id == "0"] == want[0]
    assert core.stats().free_blocks == BLOCKS
