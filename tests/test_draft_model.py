"""Speculative decoding with a draft model (worker/draft_model.py, worker/draft_runner.py, sample/rejection_sampler.py)
on tiny random Llamas: the target as its own draft has every draft accepted; a smaller draft (the target's first
layer alone) leaves greedy output token-identical, also with chunked prefill, prefix caching, preemption and pipelined
steps; the rejection sampler keeps the target's distribution with a mismatched draft; seeded rows repeat; a draft
whose vocabulary differs is refused at start-up; every block comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core.config import EngineConfig
from engine_core.sample.rejection_sampler import RowDrafts, verify_row
from engine_core.sampling_params import SamplingParams
from engine_core.worker.model_runner import ModelRunner
from tests.test_spec_decode import PROMPTS, accepted, assert_same, generate, make_core

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)


def spec(draft: Path, k: int = 4, **kw: object) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **kw}


def tiny_llama(path: Path, vocab_size: int = 128, layers: int = 1, hidden: int = 16) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
        tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def layer_skip_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller draft that agrees with the target often: the target's embeddings, first layer, norm and head."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("draft-1-layer")
    config = AutoConfig.from_pretrained(tiny_dir)
    config.num_hidden_layers = 1
    config.save_pretrained(path)
    weights = {}
    for f in sorted(tiny_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    save_file({k: v for k, v in weights.items() if ".layers.1." not in k}, path / "model.safetensors")
    return path


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_dir: Path) -> None:
    off = generate(make_core(tiny_dir, None), [GREEDY] * len(PROMPTS))
    core = make_core(tiny_dir, spec(tiny_dir))
    assert_same(off, generate(core, [GREEDY] * len(PROMPTS)))
    stats = core.scheduler.drafter.stats if core.scheduler.drafter else None
    assert stats is not None and stats.num_draft_tokens > 20
    assert stats.acceptance_rate == 1.0
    # Sampled rows: q == p, so Leviathan's test accepts every draft.
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, ignore_eos=True, max_tokens=24) for s in range(4)]
    core = make_core(tiny_dir, spec(tiny_dir))
    generate(core, sampled)
    stats = core.scheduler.drafter.stats if core.scheduler.drafter else None
    assert stats is not None and stats.num_draft_tokens > 20 and stats.acceptance_rate == 1.0


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_output_is_identical_with_a_smaller_draft(tiny_dir: Path, layer_skip_dir: Path, backend: str) -> None:
    params = [GREEDY] * len(PROMPTS)
    off = generate(make_core(tiny_dir, None, backend), params)
    core = make_core(tiny_dir, spec(layer_skip_dir), backend)
    assert_same(off, generate(core, params))
    drafter = core.scheduler.drafter
    assert drafter is not None and drafter.stats.num_draft_tokens > 0 and accepted(core) > 0


def test_chunked_prefill_prefix_caching_and_logprobs_are_unchanged(tiny_dir: Path) -> None:
    """Prompts longer than a step's token budget (the draft catches up over several proposals) sharing a cached
    prefix (the draft recomputes it), with logprobs: the target's, as without drafts. The target is its own draft,
    so a draft K/V missing or stale anywhere (a skipped chunk, a prefix block) would show as a rejected draft."""
    prompts = [[5, 6, 7, 8] * 5 + [1, 2], [5, 6, 7, 8] * 5 + [9, 9, 3], [5, 6, 7, 8] * 5 + [1, 2]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20, logprobs=2)] * 3
    kw = {"max_num_batched_tokens": 8, "enable_prefix_caching": True}
    off = generate(make_core(tiny_dir, None, **kw), params, prompts)
    core = make_core(tiny_dir, spec(tiny_dir), **kw)
    assert_same(off, generate(core, params, prompts))
    assert core.scheduler.kv.stats.hits > 0  # the third prompt found the first's blocks
    drafter = core.scheduler.drafter
    assert drafter is not None and drafter.stats.num_draft_tokens > 20 and drafter.stats.acceptance_rate == 1.0


def test_preemption_with_drafts_in_flight_recomputes_the_same_output(tiny_dir: Path, layer_skip_dir: Path) -> None:
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=34)] * 4
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, spec(layer_skip_dir), num_kv_blocks=24)
    assert_same(off, generate(core, params))
    assert core.scheduler.num_preemptions > 0 and accepted(core) > 0


def test_pipelined_steps_give_the_same_output(tiny_dir: Path, layer_skip_dir: Path) -> None:
    """Async scheduling: a speculating batch is planned after its proposals arrive; a larger one pipelines."""
    params = [GREEDY] * 4
    off = generate(make_core(tiny_dir, None, pipelined=True), params)
    core = make_core(tiny_dir, spec(layer_skip_dir), pipelined=True)
    assert_same(off, generate(core, params))
    assert accepted(core) > 0
    core = make_core(tiny_dir, spec(layer_skip_dir, disable_by_batch_size=2), pipelined=True)
    assert_same(off, generate(core, params))
    assert core.scheduler.drafter is not None and core.scheduler.drafter.stats.num_drafts == 0


def test_seeded_sampling_with_a_mismatched_draft_repeats(tiny_dir: Path, layer_skip_dir: Path) -> None:
    params = [SamplingParams(temperature=1.0, seed=7 + i, ignore_eos=True, max_tokens=30) for i in range(4)]
    runs = []
    for _ in range(2):
        core = make_core(tiny_dir, spec(layer_skip_dir))
        runs.append(generate(core, params))
        stats = core.scheduler.drafter.stats if core.scheduler.drafter else None
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected
    assert_same(runs[0], runs[1])


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(tiny_dir: Path, tmp_path: Path) -> None:
    draft = tiny_llama(tmp_path / "draft-96", vocab_size=96)
    config = EngineConfig(model=str(tiny_dir), num_kv_blocks=8, speculative_config=spec(draft))
    with pytest.raises(ValueError, match=r"draft model's vocabulary has 96 tokens, the target's 128"):
        ModelRunner(config, str(tiny_dir))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "draft_model"}, "speculative_config.model must name the draft model"),
        ({"method": "ngram", "model": "x"}, "speculative_config.model is only read by method 'draft_model'"),
    ],
)
def test_bad_draft_config_is_refused(value: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)  # type: ignore[arg-type]


def test_the_draft_cache_is_counted_in_the_blocks_that_fit(tiny_dir: Path, layer_skip_dir: Path) -> None:
    kw = {"model": str(tiny_dir), "kv_cache_memory": 0.001}
    plain = ModelRunner(EngineConfig(**kw), str(tiny_dir))
    with_draft = ModelRunner(EngineConfig(**kw, speculative_config=spec(layer_skip_dir)), str(tiny_dir))
    assert with_draft.draft is not None
    per_block = plain.info.block_bytes + with_draft.draft.model.block_bytes
    budget = int(0.001 * (1 << 30)) - with_draft.draft.scratch_blocks * with_draft.draft.model.block_bytes
    assert with_draft.profile_num_blocks() == budget // per_block < plain.profile_num_blocks()


# ---- the rejection sampler's law ----------------------------------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution_with_a_mismatched_draft() -> None:
    """20,000 rows of two drafts drawn from q (far from p): the first emitted token follows p0, the second (after an
    accepted first draft) p1, and the acceptance rate is sum(min(p0, q0)). 0.015 is over 4 standard deviations."""
    n, vocab = 20_000, 6
    p = torch.tensor([[0.05, 0.15, 0.3, 0.1, 0.25, 0.15], [0.4, 0.1, 0.1, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.3, 0.3, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])
    gen, scratch = torch.Generator().manual_seed(11), torch.Generator()
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(2)], 1).tolist()
    first, second, accepted_first = [], [], 0
    for d in drafts:
        a, token = verify_row(p, RowDrafts(d, q, None, 0), gen, scratch)
        emitted = d[:a] + ([token] if token is not None else [])
        first.append(emitted[0])
        if a >= 1:  # then position 1 emits the accepted second draft or the residual's token
            accepted_first += 1
            second.append(emitted[1])
    np.testing.assert_allclose(np.bincount(first, minlength=vocab) / n, p[0].numpy(), atol=0.015)
    assert abs(accepted_first / n - torch.minimum(p[0], q[0]).sum().item()) < 0.015
    np.testing.assert_allclose(np.bincount(second, minlength=vocab) / len(second), p[1].numpy(), atol=0.025)


def test_seeded_rows_draw_the_same_verification() -> None:
    p = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    q = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), -1)
    d = [int(q[i].argmax()) for i in range(3)]

    def run(seed: int | None, shared_seed: int) -> tuple[int, int | None]:
        return verify_row(p, RowDrafts(d, q, seed, 5), torch.Generator().manual_seed(shared_seed), torch.Generator())

    # The shared generator differs run to run; a seeded row never reads it.
    assert len({run(1234, i) for i in range(5)}) == 1
    assert len({run(None, i) for i in range(8)}) > 1  # the test can tell: unseeded draws differ
