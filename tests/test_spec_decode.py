"""Speculative decoding (engine_core/spec_decode, worker/spec_verify.py) on a tiny random Llama: outputs with drafts
are those without (greedy token for token, seeded rows too), the verification keeps the target's distribution, stops
and length limits cut an accepted run, preemption with drafts in flight recomputes, and every block comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.engine import EngineCore
from engine_core.sample.sampler import Sampler
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams
from engine_core.spec_decode.config import SpeculativeConfig
from engine_core.spec_decode.drafter import Drafter, can_speculate
from engine_core.spec_decode.ngram import propose_ngram
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.model_runner import ModelRunner
from engine_core.worker.spec_verify import Verification
from engine_core.worker.step_sampling import sample_step
from tests.threaded_runner import ThreadedRunner

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts whose continuations repeat (the random model loops on them), so drafts are proposed and accepted.
PROMPTS = [[5, 6, 7, 8] * 4, [3, 17, 5, 99, 42, 3, 17, 5], [1, 2, 3, 1, 2, 3, 1, 2], [9, 9, 9, 9]]


def make_core(model_dir: Path, spec: dict | None, backend: str = "cpu", pipelined: bool = False, **kw) -> EngineCore:
    blocks = kw.pop("num_kv_blocks", 64)
    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=blocks, max_num_seqs=kw.pop("max_num_seqs", 4),
        attention_backend=backend, speculative_config=spec, async_scheduling=pipelined, **kw,
    )  # fmt: skip
    runner = ModelRunner(config, str(model_dir))
    runner.init_kv_cache(blocks)
    executor = ThreadedRunner(runner) if pipelined else runner
    return EngineCore(config, executor, runner.max_model_len, blocks)


def generate(core: EngineCore, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> dict:
    """(request, choice) -> (tokens, logprobs of the chosen tokens, finish reason)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=False)):
        core.add_request(Request(f"r{i}", prompt, p))
    got: dict[tuple[str, int], tuple[list[int], list[float], FinishReason | None]] = {}
    drafts: dict[str, tuple[int, int]] = {}  # request -> (draft, accepted) its last output reported
    while core.has_unfinished:
        for o in core.step():
            if o.finish_reason is not None:
                drafts[o.request_id] = max(
                    drafts.get(o.request_id, (0, 0)), (o.num_draft_tokens, o.num_accepted_tokens)
                )
            tokens, lps, _ = got.get((o.request_id, o.index), ([], [], None))
            tokens += o.new_token_ids
            lps += [lp.logprobs[0] for lp in o.new_logprobs or []]
            got[(o.request_id, o.index)] = (tokens, lps, o.finish_reason)
    pool = core.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks, "every block is back in the pool once the engine is idle"
    if core.scheduler.drafter is not None:
        # Each request's final output reports its own drafts (the `request finished` line's fields); they add up
        # (every test runs one `generate` per core).
        stats = core.scheduler.drafter.stats
        totals = [sum(d for d, _ in drafts.values()), sum(a for _, a in drafts.values())]
        assert totals == [stats.num_draft_tokens, stats.num_accepted_tokens]
    return got


def accepted(core: EngineCore) -> int:
    drafter = core.scheduler.drafter
    assert drafter is not None
    return drafter.stats.num_accepted_tokens


def assert_same(a: dict, b: dict, logprob_tol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][0] == b[key][0], key
        assert a[key][2] == b[key][2], key
        np.testing.assert_allclose(a[key][1], b[key][1], atol=logprob_tol)


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_output_is_identical_with_drafts(tiny_dir: Path, backend: str) -> None:
    params = [GREEDY] * len(PROMPTS)
    off = generate(make_core(tiny_dir, None, backend), params)
    core = make_core(tiny_dir, NGRAM, backend)
    assert_same(off, generate(core, params))
    assert accepted(core) > 10  # drafts were verified and accepted, not skipped
    stats = core.stats()  # what the scheduler exports as pagoda:spec_decode_*
    assert stats.spec_decode_num_accepted_tokens == accepted(core) == sum(stats.spec_decode_num_accepted_tokens_per_pos)
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert 0 < stats.spec_decode_num_drafts <= stats.spec_decode_num_draft_tokens


def test_chunked_prefill_n_and_logprobs_are_unchanged(tiny_dir: Path) -> None:
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=25, logprobs=2),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, n=2),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=22, logprobs=0),
    ]
    off = generate(make_core(tiny_dir, None, max_num_batched_tokens=6), params)
    core = make_core(tiny_dir, NGRAM, max_num_batched_tokens=6)
    assert_same(off, generate(core, params))
    assert accepted(core) > 0


def test_a_parent_about_to_fork_gets_no_drafts(tiny_dir: Path) -> None:
    """n = 2 with a prompt that recurs: the parent's last chunk before its fork is one token that samples nothing,
    so it must not carry drafts; the choices then speculate on their own."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, n=2)]
    off = generate(make_core(tiny_dir, None, max_num_batched_tokens=6), params, [PROMPTS[1]])
    core = make_core(tiny_dir, NGRAM, max_num_batched_tokens=6)
    assert_same(off, generate(core, params, [PROMPTS[1]]))


def test_seeded_sampling_repeats_and_matches_decoding_without_drafts(tiny_dir: Path) -> None:
    """A seeded row's position i draws its output step i's noise, and rejected positions' draws are taken back."""
    params = [SamplingParams(temperature=0.7, seed=11 + i, ignore_eos=True, max_tokens=30) for i in range(4)]
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, NGRAM)
    assert_same(off, generate(core, params))
    assert accepted(core) > 0
    assert_same(off, generate(make_core(tiny_dir, NGRAM), params))


def test_a_stop_token_cuts_an_accepted_run(tiny_dir: Path) -> None:
    """The model loops on [108, 36] after prompt 0; with that loop in the prompt, the first verification accepts
    several drafts, and a stop token among them ends the output there: the tokens verified after it are dropped."""
    probe = generate(make_core(tiny_dir, None), [GREEDY])[("r0", 0)][0]
    prompt = PROMPTS[0] + probe[:6]
    stop = probe[7]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, stop_token_ids=[stop])]
    off = generate(make_core(tiny_dir, None), params, [prompt])
    core = make_core(tiny_dir, NGRAM)
    on = generate(core, params, [prompt])
    assert_same(off, on)
    tokens, _, reason = on[("r0", 0)]
    assert reason is FinishReason.STOP_TOKEN and tokens[-1] == stop
    assert accepted(core) > len(tokens) - 1  # more drafts were accepted than the output kept


def test_max_tokens_caps_the_drafts(tiny_dir: Path) -> None:
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in (13, 7, 2, 1)]
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, NGRAM)
    on = generate(core, params)
    assert_same(off, on)
    assert [len(on[(f"r{i}", 0)][0]) for i in range(4)] == [13, 7, 2, 1]


def test_max_model_len_cuts_an_accepted_run(tiny_dir: Path) -> None:
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)]
    off = generate(make_core(tiny_dir, None, max_model_len=37), params)
    core = make_core(tiny_dir, NGRAM, max_model_len=37)
    on = generate(core, params)
    assert_same(off, on)
    assert len(on[("r0", 0)][0]) == 37 - len(PROMPTS[0]) and accepted(core) > 0


def test_preemption_with_drafts_in_flight_recomputes_the_same_output(tiny_dir: Path) -> None:
    """A pool of 24 blocks (96 tokens) for four sequences growing to ~46 tokens each: some are preempted, drafts
    included, and resume; the output is unchanged and every block comes back."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=34)] * 4
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, NGRAM, num_kv_blocks=24)
    assert_same(off, generate(core, params))
    assert core.scheduler.num_preemptions > 0 and accepted(core) > 0


def test_pipelined_steps_give_the_same_output(tiny_dir: Path) -> None:
    """Async scheduling: a batch small enough to speculate is planned step by step; a larger one pipelines."""
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5, ignore_eos=True, max_tokens=30, logprobs=1)] * 2
    off = generate(make_core(tiny_dir, None, pipelined=True), params)
    core = make_core(tiny_dir, NGRAM, pipelined=True)
    assert_same(off, generate(core, params))
    assert accepted(core) > 0


def test_requests_with_state_reading_processors_decode_one_token_per_step(tiny_dir: Path) -> None:
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, min_tokens=3),
    ]
    assert not any(can_speculate(p) for p in params)
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, NGRAM)
    assert_same(off, generate(core, params))
    assert core.scheduler.drafter is not None and core.scheduler.drafter.stats.num_drafts == 0


def test_large_batches_propose_nothing(tiny_dir: Path) -> None:
    spec = {**NGRAM, "disable_by_batch_size": 2}
    core = make_core(tiny_dir, spec)
    generate(core, [GREEDY] * 4)
    drafts_when_big = core.scheduler.drafter.stats.num_drafts if core.scheduler.drafter else -1
    # Every sequence runs to the same length, so all four run together to the end: nothing is proposed.
    assert drafts_when_big == 0


# ---- the verification's law -----------------------------------------------------------------------------------------
def test_verification_keeps_the_target_distribution() -> None:
    """Many sequences, each with one draft (a point mass on token 2), verified against fixed target distributions:
    the first emitted token follows p0 (not the draft), the draft is accepted with probability p0(2), and the token
    after an accepted draft follows p1. 20,000 rows: a 0.015 tolerance is over 4 standard deviations."""
    n, vocab, draft = 20_000, 6, 2
    p0 = torch.tensor([0.05, 0.15, 0.3, 0.1, 0.25, 0.15])
    p1 = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.1, 0.1])
    batch = SamplingBatch(vocab, "cpu", n, seed=1234)
    for s in range(n):
        batch.add(s, SamplingParams(temperature=1.0), None, [0], [])
    row_ids = [s for s in range(n) for _ in range(2)]
    logits = torch.stack([p0.log(), p1.log()]).repeat(n, 1)
    sampled = sample_step(Sampler(), batch, logits, row_ids, batch.metadata(row_ids))
    verify = Verification(
        logit_index=np.arange(2 * n), row_seq_ids=row_ids, owner=np.repeat(np.arange(n), 2),
        seq_ids=list(range(n)), drafts=[[draft]] * n,
    )  # fmt: skip
    keep, acc = verify.accept(sampled.tokens)
    tokens = sampled.tokens[keep]
    starts = np.cumsum([0] + [a + 1 for a in acc[:-1]])
    first = tokens[starts]
    freq0 = np.bincount(first, minlength=vocab) / n
    np.testing.assert_allclose(freq0, p0.numpy(), atol=0.015)
    assert abs(np.mean(acc) - p0[draft].item()) < 0.015
    second = tokens[starts[np.asarray(acc) == 1] + 1]
    np.testing.assert_allclose(np.bincount(second, minlength=vocab) / len(second), p1.numpy(), atol=0.025)


def test_verification_of_a_greedy_row_is_the_longest_matching_prefix() -> None:
    verify = Verification(
        logit_index=np.arange(7), row_seq_ids=[0] * 4 + [1] * 3, owner=np.array([0] * 4 + [1] * 3),
        seq_ids=[0, 1], drafts=[[4, 5, 6], [8, 9]],
    )  # fmt: skip
    keep, acc = verify.accept(np.array([4, 5, 7, 1, 8, 9, 3]))
    assert keep.tolist() == [0, 1, 2, 4, 5, 6] and acc == [2, 2]


# ---- the proposer and its config ------------------------------------------------------------------------------------
def test_ngram_proposes_the_latest_occurrences_continuation() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([5, 1, 5, 2, 5], 2, 1, 2) == [2, 5]  # n = 2 finds nothing; n = 1 the latest 5
    assert propose_ngram([4, 4], 5, 1, 1) == [4]


def test_drafter_backs_off_to_one_token_probes_after_rejections() -> None:
    drafter = Drafter(SpeculativeConfig(**NGRAM))
    tokens, params = [5, 6, 7, 8, 9, 1, 2, 3, 5, 6], SamplingParams()
    full = drafter.propose(0, tokens, params, 4)
    assert full == [7, 8, 9, 1]
    drafter.record(0, 4, 0)
    assert drafter.propose(0, tokens, params, 4) == full[:1]  # one chance drafts a one-token probe
    assert drafter.propose(0, tokens, params, 4) == full
    drafter.record(0, 4, 0)  # a second miss in a row: three probe chances
    assert [len(drafter.propose(0, tokens, params, 4)) for _ in range(4)] == [1, 1, 1, 4]
    drafter.record(0, 4, 2)  # accepted: the back-off ends
    assert drafter.propose(0, tokens, params, 4) == full
    drafter.record(0, 4, 0)
    assert drafter.propose(0, tokens, params, 4) == full[:1]
    drafter.record(0, 1, 0)  # a rejected probe is a miss too: three probe chances follow
    assert [len(drafter.propose(0, tokens, params, 4)) for _ in range(4)] == [1, 1, 1, 4]
    drafter.record(0, 4, 0)
    drafter.record(0, 1, 1)  # an accepted probe ends the back-off
    assert drafter.propose(0, tokens, params, 4) == full
    assert drafter.propose(0, tokens, params, 0) == []  # no room: max_tokens or max_model_len reached
    # a sequence that speculates on its own stays out of another's back-off
    assert drafter.propose(1, tokens, params, 4) == full


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa"}, "speculative_config.method must be one of"),
        ({"prompt_lookup_max": 33}, "speculative_config.prompt_lookup_max must be <= 32"),
        ({"method": "draft_model"}, "speculative_config.model must name the draft model"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens must be <= 64"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_token": 3}, "unknown key"),
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_bad_config_is_refused_at_start_up(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]


def test_a_draft_model_is_refused_with_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        EngineConfig(speculative_config={"method": "draft_model", "model": "m"}, tensor_parallel_size=3)  # type: ignore[arg-type]


def test_config_parses_json_and_dicts() -> None:
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')  # type: ignore[arg-type]
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    assert EngineConfig(speculative_config="").speculative_config is None  # type: ignore[arg-type]
    assert SpeculativeConfig.parse(config.speculative_config.to_json()) == config.speculative_config


def test_drafts_are_written_after_the_known_tokens() -> None:
    from engine_core.worker.spec_verify import write_drafts

    batch = InputBatch(2, 16, 4, 4)
    batch.add(7, [1, 2, 3], 3, [0], 2, SamplingParams())
    write_drafts(batch, {7: [4, 5]})
    inputs = batch.prepare([7], [3])
    assert inputs.input_ids.tolist() == [3, 4, 5] and inputs.positions.tolist() == [2, 3, 4]
    assert batch.num_tokens[batch.row_of[7]] == 3
