"""The model runner on a tiny random Llama (`tiny_dir`, tests/conftest.py): plans in, tokens out, against
transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine_core.config import EngineConfig
from engine_core.plan import CachedSequenceData, NewSequenceData, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.worker.host_allocator import HeapRelease
from engine_core.worker.model_runner import ModelRunner
from tests.hf_reference import hf_greedy

BS = 4


def make_runner(model_dir: Path, backend: str) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir), block_size=BS, num_kv_blocks=32, max_num_seqs=4, attention_backend=backend
    )
    runner = ModelRunner(config, str(model_dir))
    runner.init_kv_cache(32)
    return runner


def greedy(runner: ModelRunner, prompts: dict[int, list[int]], steps: int) -> dict[int, list[int]]:
    """Drives the runner the way the scheduler does: each sequence in full once, then only new blocks."""
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    blocks = {seq_id: list(range(seq_id * 8, seq_id * 8 + 8)) for seq_id in prompts}  # 8 blocks = 32 tokens each
    plan = SchedulerOutput(
        new_seqs=[NewSequenceData(s, p, len(p), params, None, blocks[s], 0, f"r{s}") for s, p in prompts.items()],
        num_scheduled_tokens={s: len(p) for s, p in prompts.items()},
    )
    out: dict[int, list[int]] = {s: [] for s in prompts}
    lens = {s: len(p) for s, p in prompts.items()}
    for _ in range(steps):
        plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
        result = runner.execute(plan)
        assert sorted(result.seq_ids) == sorted(prompts)
        for seq_id, token in zip(result.seq_ids, result.sampled_token_ids, strict=True):
            out[seq_id].append(token)
        plan = SchedulerOutput(
            cached_seqs=[CachedSequenceData(s, [], lens[s] + len(out[s]) - 1) for s in prompts],
            num_scheduled_tokens=dict.fromkeys(prompts, 1),
        )
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_runner_greedy_matches_transformers(tiny_dir: Path, backend: str) -> None:
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = {0: [3, 17, 5, 99, 42], 1: [7], 2: [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    got = greedy(make_runner(tiny_dir, backend), prompts, steps=6)
    for seq_id, prompt in prompts.items():
        assert got[seq_id] == hf_greedy(ref, prompt, 6)


def test_the_runner_gives_the_heap_back_once_decode_steps_follow_a_prefill(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir, "cpu")
    assert isinstance(runner.heap_release, HeapRelease)  # every CPU runner has one
    # NOTE: the tiny model's prompts are short: a "large" step here is 16 tokens (the default 256)
    runner.heap_release = HeapRelease(large_tokens=16, settle_steps=4)
    prompts = {s: list(range(1 + s, 21 + s)) for s in range(3)}  # one 60-token prefill step, then 3-row decode steps
    greedy(runner, prompts, steps=4)  # the prefill and 3 decode steps: not settled yet
    assert runner.heap_release.releases == 0
    runner.reset()
    greedy(runner, prompts, steps=6)  # another prefill, then 5 decode steps
    assert runner.heap_release.releases == 1


def test_reset_forgets_every_sequence(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir, "torch")
    prompts = {0: [3, 17, 5], 1: [7, 8]}
    first = greedy(runner, prompts, steps=3)
    assert len(runner.batch) == 2 and len(runner.sampling) == 2
    runner.reset()
    assert len(runner.batch) == 0 and len(runner.sampling) == 0
    assert greedy(runner, prompts, steps=3) == first  # the same seq ids are accepted again, from scratch


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_a_checkpoint_missing_a_weight_is_refused(tiny_dir: Path, tmp_path: Path, name: str) -> None:
    """Parameters are allocated, not initialised (model/llama.Linear): a weight the checkpoint lacks must fail the
    load, never serve uninitialised memory."""
    model_dir = tmp_path / "incomplete"
    shutil.copytree(tiny_dir, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights[name]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights missing from checkpoint"):
        make_runner(model_dir, "torch")
