from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_fused_add_rms_norm, ref_rms_norm, ref_rotary_neox, ref_silu_and_mul
from kernels.triton import fused_add_rms_norm, rms_norm, rotary_embedding_neox, silu_and_mul
from tests.kernels.conftest import DEVICE, DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])  # 576 = SmolLM2-135M hidden size: not a power of two
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x = torch.randn(2, 5, hidden, dtype=dtype, device=DEVICE) * 3
    w = torch.rand(hidden, dtype=dtype, device=DEVICE) + 0.5
    out = rms_norm(x, w, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close("rms_norm", out, ref_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype: torch.dtype) -> None:
    x = torch.randn(7, 576, dtype=dtype, device=DEVICE)
    residual = torch.randn(7, 576, dtype=dtype, device=DEVICE)
    w = torch.rand(576, dtype=dtype, device=DEVICE) + 0.5
    expected_out, expected_residual = ref_fused_add_rms_norm(x, residual, w, 1e-6)
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    assert new_residual is residual  # updated in place
    assert_close("fused_add_rms_norm", new_residual, expected_residual, dtype)
    assert_close("fused_add_rms_norm", out, expected_out, dtype)


def _cos_sin(max_pos: int, rot_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (128, 128), (96, 64)])
def test_rotary_neox(dtype: torch.dtype, head_dim: int, rot_dim: int) -> None:
    num_tokens = 9
    positions = torch.randint(0, 100, (num_tokens,), device=DEVICE)
    cos, sin = _cos_sin(128, rot_dim, torch.float32)
    # q as a strided view (a slice of a fused qkv), k with a different head count (GQA).
    qkv = torch.randn(num_tokens, 5, head_dim, dtype=dtype, device=DEVICE)
    q, k = qkv[:, :3], qkv[:, 3:]
    expected_q, expected_k = ref_rotary_neox(positions, q, k, cos, sin)
    untouched = qkv[..., rot_dim:].clone()
    rotary_embedding_neox(positions, q, k, cos, sin)
    assert_close("rotary_neox", q, expected_q, dtype)
    assert_close("rotary_neox", k, expected_k, dtype)
    assert torch.equal(qkv[..., rot_dim:], untouched)


def test_rotary_neox_with_per_token_rows() -> None:
    """positions=None: cos/sin hold one row per token (the model's per-step lookup), here a strided half of it."""
    positions = torch.randint(0, 100, (6,), device=DEVICE)
    cos, sin = _cos_sin(128, 64, torch.float32)
    full_cos, full_sin = torch.cat((cos, cos), -1)[positions], torch.cat((sin, sin), -1)[positions]  # [T, D]
    qkv = torch.randn(6, 5, 64, device=DEVICE)
    q, k = qkv[:, :3], qkv[:, 3:]
    expected_q, expected_k = ref_rotary_neox(positions, q, k, cos, sin)
    rotary_embedding_neox(None, q, k, full_cos[:, :32], full_sin[:, :32])
    assert_close("rotary_neox", q, expected_q, torch.float32)
    assert_close("rotary_neox", k, expected_k, torch.float32)


def test_rotary_reference_matches_hf_llama() -> None:
    # Ties our reference to the model we serve: HF Llama's apply_rotary_pos_emb (cos/sin = cat(freqs, freqs)).
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions = torch.arange(11)
    cos, sin = _cos_sin(16, 64, torch.float32)
    q, k = torch.randn(11, 4, 64), torch.randn(11, 2, 64)
    hf_cos = torch.cat((cos, cos), dim=-1).cpu()[positions][None]  # [1, T, D]
    hf_sin = torch.cat((sin, sin), dim=-1).cpu()[positions][None]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    ref_q, ref_k = ref_rotary_neox(positions, q, k, cos.cpu(), sin.cpu())
    torch.testing.assert_close(ref_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(ref_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1536])  # 1536 = SmolLM2-135M intermediate size: > one 1024-wide program
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    x = torch.randn(3, 2, 2 * inter, dtype=dtype, device=DEVICE) * 2
    out = silu_and_mul(x)
    assert out.shape == (3, 2, inter) and out.dtype == dtype
    assert_close("silu_and_mul", out, ref_silu_and_mul(x), dtype)
