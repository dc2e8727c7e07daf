"""Tensor parallelism (engine_core/distributed, model/layers/parallel_linear.py and vocab_parallel.py): a tiny random
Llama split over 2 and 4 ranks (4 heads / 2 KV heads: at 4 ranks each KV head is replicated on two) gives the
single-rank engine's tokens, greedy and seeded, and its logprobs within 1e-4 relative; rank processes are real
(`LLM(tensor_parallel_size=N)` spawns them, gloo between them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.distributed.parallel_state import TensorParallel, check_heads
from engine_core.model.layers.parallel_linear import qkv_parallel
from engine_core.worker.model_runner import ModelRunner
from engine_core.worker.rank_processes import RankProcessError
from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded

VOCAB = 130  # not a multiple of 4: the last rank's vocabulary part is padded at TP=4
PROMPTS = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((1, 9, 17, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20, prompt_logprobs=20)
SEEDED = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True) for i in range(4)]
UNSEEDED = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)  # the engine's shared generator (seed 0)
ENGINE = dict(kv_cache_memory=0.01, max_num_batched_tokens=32)


def tiny_llama(path: Path, smollm2_dir: str, gguf: bool = False) -> Path:
    """A random Llama of 4 heads / 2 KV heads (splits over 1, 2 and 4 ranks) with SmolLM2's tokenizer beside it."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,  # peaky logits: argmax is not decided by rounding noise
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if gguf:  # projections as Q4_1 blocks decoded, as the default model's are
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2 and "embed" not in name and "lm_head" not in name:
                    param.copy_(ref_gguf_decoded(param, "q4_1"))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tp-tiny"), smollm2_dir)


def _run(llm: LLM) -> dict[str, list]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "logprobs": [o.outputs[0].logprobs for o in greedy],
        "prompt_logprobs": [o.prompt_logprobs for o in greedy],
        "seeded": [o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)],
        "unseeded": [o.outputs[0].token_ids for o in llm.generate(prompts, UNSEEDED, use_tqdm=False)],
    }


@pytest.fixture(scope="module")
def single_rank(tiny: Path) -> dict[str, list]:
    return _run(LLM(str(tiny), **ENGINE))


def _assert_close(ours: list, ref: list) -> int:
    """Every position's top logprobs: the same tokens, values within 1e-4 relative. Returns the values compared."""
    n = 0
    for a, b in zip(ours, ref, strict=True):
        if a is None or b is None:
            assert a is b
            continue
        assert a.keys() == b.keys()
        for tok in a:
            assert a[tok].logprob == pytest.approx(b[tok].logprob, rel=1e-4, abs=1e-6)
            n += 1
    return n


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_give_the_single_rank_output_and_shutdown_stops_them(
    tiny: Path, single_rank: dict[str, list], size: int
) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=size, **ENGINE)
    procs = list(llm.engine.tensor_parallel.ranks.procs)
    try:
        assert len(procs) == size - 1 and all(p.is_alive() for p in procs)
        assert llm.engine.runner.model.layers[0].self_attn.num_heads == 4 // size
        ours = _run(llm)
    finally:
        llm.shutdown()
    # NOTE: the shutdown checks ride on this engine: one more engine of rank processes only to stop them cost seconds.
    assert not any(p.is_alive() for p in procs)
    llm.shutdown()  # idempotent
    assert ours["greedy"] == single_rank["greedy"]
    assert ours["seeded"] == single_rank["seeded"]
    assert ours["unseeded"] == single_rank["unseeded"]
    compared = 0
    for kind in ("logprobs", "prompt_logprobs"):
        for a, b in zip(ours[kind], single_rank[kind], strict=True):
            compared += _assert_close(a, b)
    assert compared > 1000


def test_a_dead_rank_fails_the_step_with_its_name(tiny: Path) -> None:
    llm = LLM(str(tiny), tensor_parallel_size=2, **ENGINE)
    try:
        rank1 = llm.engine.tensor_parallel.ranks.procs[0]
        rank1.kill()
        rank1.join()
        with pytest.raises(RankProcessError, match="rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)
        with pytest.raises(RankProcessError, match="create a new LLM"):  # broken for good, never a hang
            llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_sizes_that_do_not_split_the_heads_are_refused(tiny: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(str(tiny), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 neither divides nor is a multiple of the model's 6"):
        check_heads(12, 6, 4)
    check_heads(9, 3, 3)  # SmolLM2 at 3 ranks
    check_heads(4, 2, 4)  # KV heads replicated


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    """4 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1 (query heads 0-1 use KV
    head 0 and 2-3 KV head 1), as vLLM's QKVParallelLinear does."""
    slices = [qkv_parallel(64, 4, 2, 16, False, TensorParallel(r, 4)).slices for r in range(4)]
    assert [s[0] for s in slices] == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert [s[1] for s in slices] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    assert all(s[1] == s[2] for s in slices)


@pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()),
    reason="no vectorized coded kernel: linears keep no codes here (CpuGemmRows.for_this_cpu)",
)
def test_gguf_coded_shards_keep_their_codes(tmp_path: Path, smollm2_dir: str) -> None:
    """A Q4_1 model's shards are whole blocks of 32 (column-parallel: output rows; row-parallel: input blocks), so
    each rank's linears keep the codes, at about half the single rank's bytes each (loading needs no group)."""
    model_dir = str(tiny_llama(tmp_path / "coded", smollm2_dir, gguf=True))
    whole = ModelRunner(EngineConfig(model=model_dir), model_dir)
    ranks = [ModelRunner(EngineConfig(model=model_dir, tensor_parallel_size=2), model_dir, rank=r) for r in (0, 1)]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        full = whole.model.layers[0].get_submodule(name)
        assert full.cpu_forms is not None and full.cpu_forms.coded is not None
        for runner in ranks:
            part = runner.model.layers[0].get_submodule(name)
            assert part.cpu_forms is not None and part.cpu_forms.coded is not None, name
            assert part.resident_bytes() * 2 == pytest.approx(full.resident_bytes(), rel=0.05), name


@pytest.mark.slow
def test_smollm2_at_three_ranks_equals_one_rank(smollm2_dir: str, offline_llm: LLM) -> None:
    """The real model in float32 (9 heads / 3 KV heads: one KV head per rank; its Q4_1 shards keep their codes) gives
    the single rank's greedy tokens on the greedy-equality prompts, and its logprobs within 1e-4 relative."""
    from tests.test_greedy_equality import MAX_TOKENS
    from tests.test_greedy_equality import PROMPTS as GREEDY_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    # NOTE: the single rank is the session's float32 engine (tensor_parallel_size=1).
    outs = {1: [o.outputs[0] for o in offline_llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)]}
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.1, tensor_parallel_size=3)
    try:
        outs[3] = [o.outputs[0] for o in llm.generate(GREEDY_PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    for one, three in zip(outs[1], outs[3], strict=True):
        assert three.token_ids == one.token_ids
        assert _assert_close(three.logprobs, one.logprobs) > 0
