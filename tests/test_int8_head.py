"""The LM head inside the int8 native decode step (kernels/cpu/decode_int8.cpp, worker/head_step.py): its logits are
the unfused path's bits, its fused greedy pick gives the unfused tokens (ties to the lowest index, across the threads'
shares), a non-finite row fails alone, and the runner takes the fused pick only where nothing else reads the logits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine_core import LLM, SamplingParams
from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
from engine_core.model.layers.cpu_int8 import int8_dot_products
from engine_core.model.layers.linear import Linear
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.sample.sampler import FAILED_TOKEN, row_argmax
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.worker.head_step import greedy_pick_suffices
from engine_core.worker.step_sampling import UNSAMPLEABLE, picked_step
from kernels import cpu as cpu_kernels
from tests.test_model_families import VOCAB, _tiny

pytestmark = pytest.mark.skipif(not int8_dot_products(this_cpu_flags()), reason="no int8 dot products here")

PROMPT_LENS = (3, 40, 1, 17, 9)


@pytest.fixture(scope="module")
def int8_llm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> Iterator[LLM]:
    """A tiny int8 Llama with every projection weight-only at every row count, so each decode step can fuse."""
    model_dir = _tiny("llama", tmp_path_factory.mktemp("llama"), smollm2_dir)
    llm = LLM(str(model_dir), quantization="int8", kv_cache_memory=0.05, enable_prefix_caching=False)
    runner = llm.core.executor
    if not isinstance(runner.decode_step, NativeDecodeStep) or runner.decode_step.head is None:
        pytest.skip("the native int8 decode step is unavailable here")
    for layer in runner.model.modules():
        if isinstance(layer, Linear) and layer.cpu_forms is not None and layer.cpu_forms.int8 is not None:
            layer.cpu_forms.int8.w8a8_m = 1 << 62
    runner.decode_step = NativeDecodeStep(runner.model)
    yield llm


def _prompts() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in PROMPT_LENS]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fused_head_gives_the_unfused_tokens(int8_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generations (five rows, then batch 1) through the fused pick, the fused head's logits (a logit_bias
    processor reads them) and the unfused paths (the native step with the head as its own call, the layer loop):
    the same tokens; the fused kernel ran in the fused runs, with and without the pick as the runner chose."""
    runner = int8_llm.core.executor
    native = runner.decode_step
    calls: list[bool] = []
    kernel = cpu_kernels.decode_int8_head

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(bool(args[-1]))  # `greedy`
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "decode_int8_head", counted)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts()
    # a processor that reads the logits: the greedy outputs' third tokens banned, so every row's text moves
    banned = {out[2]: -100.0 for out in _tokens(int8_llm, greedy, prompts)}
    biased = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=banned)
    runs = {}
    for name in ("fused", "head apart", "layer loop"):
        if name == "head apart":
            runner.decode_step = NativeDecodeStep(runner.model)
            runner.decode_step.head = None
        elif name == "layer loop":
            runner.decode_step = None
        calls.clear()
        runs[name] = (_tokens(int8_llm, greedy, prompts), _tokens(int8_llm, biased, prompts))
        runs[name] += (_tokens(int8_llm, greedy, prompts[:1]),)
        if name == "fused":
            # every decode step of the greedy runs picked in the head; the biased run's read its logits
            assert calls.count(True) == 2 * 7 and calls.count(False) == 7, calls
        else:
            assert not calls
    runner.decode_step = native
    assert runs["fused"] == runs["head apart"] == runs["layer loop"]
    assert all(a[2] != b[2] for a, b in zip(*runs["fused"][:2], strict=True))  # the biased steps read the logits


def test_the_fused_pick_takes_the_lowest_tied_index_and_fails_a_nonfinite_row_alone(int8_llm: LLM) -> None:
    """The kernel directly, two rows split over two threads: the pick is the first maximum of the head's own logits
    (row_argmax's), also when a lower channel ties the winner across the threads' shares; a row with an inf in its
    hidden state has NaN logits, a NaN maximum and FAILED_TOKEN, so `picked_step` fails it and keeps the other; an
    input id outside the embedding table is refused by name."""
    runner = int8_llm.core.executor
    step = runner.decode_step
    assert isinstance(step, NativeDecodeStep) and step.head is not None
    hidden = runner.model.norm.weight.numel()
    embedding = torch.randn(2, hidden, generator=torch.Generator().manual_seed(1))  # the two rows' own table
    embedding[0, hidden // 3] = float("inf")
    block = int8_llm.core.config.block_size
    inputs = (
        torch.tensor([0, 1]),
        torch.tensor([0, 0]),
        embedding,
        None,  # a float32 table: no per-row scales
        runner.model.rotary.cos,
        runner.model.rotary.sin,
        runner.kv_caches,
        torch.tensor([0, block], dtype=torch.int64),
        torch.tensor([[0], [1]], dtype=torch.int32),
        torch.tensor([1, 1], dtype=torch.int32),
        step.weights,
        step.head,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    codes, scale = step.head.codes, step.head.scale
    saved = {tie: (codes[tie].clone(), scale[tie].clone()) for tie in (3, VOCAB - 5)}
    try:
        logits, _ = cpu_kernels.decode_int8_head(*inputs, greedy=False)
        row_max, tokens = cpu_kernels.decode_int8_head(*inputs, greedy=True)
        assert torch.isnan(logits[0]).all() and torch.isnan(row_max[0])
        want_max, want = row_argmax(logits[1:])
        assert tokens[0] == FAILED_TOKEN and tokens[1] == want[0] and row_max[1] == want_max[0]
        winner = int(want[0])
        assert 3 < winner < VOCAB - 5
        # channels 3 (the first thread's share) and VOCAB - 5 (the second's) now tie the winner
        for tie in (3, VOCAB - 5):
            codes[tie], scale[tie] = codes[winner], scale[winner]
        logits, _ = cpu_kernels.decode_int8_head(*inputs, greedy=False)
        row_max, tokens = cpu_kernels.decode_int8_head(*inputs, greedy=True)
        assert logits[1, 3] == logits[1, VOCAB - 5] == logits[1, winner] == row_max[1]
        assert tokens[1] == 3 == row_argmax(logits[1:])[1][0]
    finally:
        for tie, (c, sc) in saved.items():
            codes[tie], scale[tie] = c, sc
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match=r"input_ids 2 is outside \[0, 2\)"):  # checked before any work
        cpu_kernels.decode_int8_head(torch.tensor([0, 2]), *inputs[1:], greedy=True)
    sampling = SamplingBatch(VOCAB, "cpu", 4)
    for seq_id in (10, 11):
        sampling.add(seq_id, SamplingParams(temperature=0), None, [1, 2], [])
    result = picked_step(sampling, tokens, [10, 11])
    assert result.tokens.tolist() == [FAILED_TOKEN, 3] and result.errors == {10: UNSAMPLEABLE}


def test_the_pick_is_fused_only_where_nothing_else_reads_the_logits() -> None:
    """`greedy_pick_suffices` on real sampling metadata: all greedy with no argmax-moving processor and no logprobs."""
    sampling = SamplingBatch(VOCAB, "cpu", 8)
    cases = {
        1: (SamplingParams(temperature=0), True),
        2: (SamplingParams(temperature=0.7, top_k=1), True),  # top_k=1 samples as greedy
        3: (SamplingParams(temperature=0, logprobs=2), False),
        4: (SamplingParams(temperature=0, logit_bias={5: 1.0}), False),
        5: (SamplingParams(temperature=0, repetition_penalty=1.3), False),
        6: (SamplingParams(temperature=0.7), False),
    }
    for seq_id, (params, _) in cases.items():
        sampling.add(seq_id, params, None, [1, 2, 3], [])
    for seq_id, (_, fused) in cases.items():
        assert greedy_pick_suffices(sampling.metadata([seq_id])) is fused, seq_id
    assert greedy_pick_suffices(sampling.metadata([1, 2]))
    assert not greedy_pick_suffices(sampling.metadata([1, 3]))
    assert not greedy_pick_suffices(None)  # the step's metadata failed to build: the sampler's row-by-row path
