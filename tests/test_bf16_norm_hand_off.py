"""With bf16 CPU GEMMs the RMSNorm reads o_proj's and down's bf16 products and writes the next GEMM's bf16 input,
and the rotary reads qkv's (kernels/cpu/fused_ops.cpp `rms_norm_to` and `rotary_embedding_to`,
layer_ops.NativeCpuBf16Ops, and the native decode step): the bits of the casts they replace, checked against them op
by op and through a whole runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.model.layers.cpu_bfloat16 import BF16_CODED_M
from engine_core.model.layers.layer_ops import CosSin, NativeCpuBf16Ops, NativeCpuOps
from engine_core.plan import CachedSequenceData, NewSequenceData, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.worker.model_runner import ModelRunner
from kernels import cpu as cpu_kernels
from tests.test_cpu_bfloat16 import has_bf16_gemms

BS = 4


def _cast_path(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, out_dtype: torch.dtype):
    """What the norm computed between the casts: x widened, the fp32 norm in place, the output rounded."""
    h = x.float().clone()
    res = None if residual is None else residual.clone()
    cpu_kernels.add_rms_norm(h, res, w, 1e-5)
    return h.to(out_dtype), res


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_to_gives_the_bits_of_the_casts_around_the_fp32_norm(
    x_dtype: torch.dtype, out_dtype: torch.dtype, with_residual: bool
) -> None:
    torch.manual_seed(0)
    n = 576 + 5  # a tail past the last full vector
    x = (torch.randn(37, n) * 3).to(x_dtype)
    residual = torch.randn(37, n) * 10 if with_residual else None
    w = torch.rand(n) + 0.5
    want, want_res = _cast_path(x, residual, w, out_dtype)
    out = torch.empty(37, n, dtype=out_dtype)
    res = None if residual is None else residual.clone()
    cpu_kernels.rms_norm_to(out, x, res, w, 1e-5)
    assert torch.equal(out, want)
    if residual is not None:
        assert res is not None and want_res is not None and torch.equal(res, want_res)
        assert not torch.equal(res, residual)  # the residual add happened in place


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
def test_rotary_embedding_to_gives_the_bits_of_the_cast_and_the_rotation() -> None:
    torch.manual_seed(0)
    heads, kv_heads, d, t = 9, 3, 64, 21
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).bfloat16()
    cos, sin = torch.randn(t, d), torch.randn(t, d)
    want = qkv.float()
    cpu_kernels.rotary_embedding(want, cos, sin, heads + kv_heads, d)
    out = torch.empty(qkv.shape)
    cpu_kernels.rotary_embedding_to(out, qkv, cos, sin, heads + kv_heads, d)
    assert torch.equal(out, want)
    assert torch.equal(out[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :].float())  # v: widened only


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
def test_the_bf16_ops_write_bf16_from_their_row_threshold_and_the_final_norm_fp32() -> None:
    ops = NativeCpuBf16Ops(BF16_CODED_M)
    w = torch.rand(64) + 0.5
    for rows, dtype in ((BF16_CODED_M - 1, torch.float32), (BF16_CODED_M, torch.bfloat16)):
        x = torch.randn(rows, 64).bfloat16()
        residual = torch.randn(rows, 64)
        out, res = ops.add_rms_norm(x, residual, w, 1e-5)
        assert out.dtype == dtype and res is residual
        first, embedding = ops.add_rms_norm(residual, None, w, 1e-5)  # the first layer: x is the residual
        assert embedding is residual and first.dtype == dtype
    final, _ = ops.fp32_out().add_rms_norm(torch.randn(64, 64).bfloat16(), torch.randn(64, 64), w, 1e-5)
    assert final.dtype == torch.float32


def _runner(model_dir: Path) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", block_size=BS, num_kv_blocks=96, max_num_seqs=12)
    runner = ModelRunner(config, str(model_dir))
    runner.init_kv_cache(96)
    return runner


def _greedy_logprobs(runner: ModelRunner, prompts: dict[int, list[int]], steps: int) -> list[torch.Tensor]:
    """Each step's sampled tokens and top-2 logprobs (a prefill step, then decode steps of every sequence)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=2)
    blocks = {s: list(range(s * 8, s * 8 + 8)) for s in prompts}
    plan = SchedulerOutput(
        new_seqs=[NewSequenceData(s, p, len(p), params, None, blocks[s], 0, f"r{s}") for s, p in prompts.items()],
        num_scheduled_tokens={s: len(p) for s, p in prompts.items()},
    )
    got: list[torch.Tensor] = []
    lens = {s: len(p) for s, p in prompts.items()}
    for step in range(steps):
        plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
        result = runner.execute(plan)
        assert result.logprobs is not None
        got += [torch.as_tensor(result.logprobs.token_ids).double(), torch.as_tensor(result.logprobs.logprobs).double()]
        plan = SchedulerOutput(
            cached_seqs=[CachedSequenceData(s, [], lens[s] + step) for s in prompts],
            num_scheduled_tokens=dict.fromkeys(prompts, 1),
        )
    return got


class _WidenedProducts(NativeCpuOps):
    """The casts the hand-off replaces: the GEMMs' bf16 products widened to fp32 before the plain native norm and
    rotary (and the norm's fp32 output rounded to bf16 by the next GEMM)."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().add_rms_norm(x.float(), residual, weight, eps)

    def split_rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: CosSin, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return super().split_rotate_qkv(qkv.float(), cos_sin, num_heads, num_kv_heads, head_dim)


@has_bf16_gemms
def test_a_bf16_runner_gives_the_bits_of_the_casts_with_the_norm_hand_off(tiny_dir: Path) -> None:
    """10 sequences (decode steps of 10 rows, above BF16_CODED_M): the prefill step's layer loop and the native decode
    step with the hand-off against the same runner with the casts (the plain native ops on the widened bf16
    products, the layer loop for decode steps): the same tokens and logprobs, bit for bit."""
    prompts = {s: [(7 * s + 3 * i) % 200 + 1 for i in range(5 + s)] for s in range(10)}
    runner = _runner(tiny_dir)
    assert isinstance(runner.model.layers[0].input_layernorm.ops, NativeCpuBf16Ops)
    assert runner.decode_step is not None
    fused = _greedy_logprobs(runner, prompts, steps=4)
    runner.reset()
    plain = _WidenedProducts()
    for layer in runner.model.layers:
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp):
            module.ops = plain
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert proj.cpu_forms is not None and proj.cpu_forms.bf16_out
    runner.model.norm.ops = plain
    runner.decode_step = None
    cast = _greedy_logprobs(runner, prompts, steps=4)
    for a, b in zip(fused, cast, strict=True):
        assert torch.equal(a, b)
