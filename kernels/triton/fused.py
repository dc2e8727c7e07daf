"""Small fused elementwise kernels for the Llama block: RMSNorm (+ residual add), neox rotary embedding, SiLU·mul.

All compute in fp32 and round once on store, so they are at least as accurate as the unfused HF modules they replace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import pow2_at_least


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # NOTE: the sum is rounded to the activation dtype and stored (it is the next layer's residual), and the norm
        # reads the rounded value, exactly like HF's `residual + hidden_states` in bf16 followed by the norm.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype
        )
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    x2 = x.reshape(-1, hidden)
    assert x2.stride(-1) == 1, "rms_norm needs a contiguous hidden dim"
    out = torch.empty_like(x2)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous(), "residual is updated in place"
    r2 = residual.view(-1, hidden) if residual is not None else x2
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            eps,
            HIDDEN=hidden,
            BLOCK=pow2_at_least(hidden),
            HAS_RESIDUAL=residual is not None,
        )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / rms(x) * weight` over the last dim (x: `[..., hidden]`)."""
    return _rms_norm_launch(x, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` (in place), then returns `(rms_norm(residual), residual)`."""
    return _rms_norm_launch(x, residual, weight, eps), residual


@triton.jit
def _rotary_neox_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_cos,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:  # noqa: SIM108 - a static branch: the load must not exist without positions
        pos = tl.load(positions_ptr + token).to(tl.int64)
    else:  # cos/sin already hold one row per token
        pos = token
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    ptr1 = x_ptr + token * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # rotate_half(x) = cat(-x2, x1); cos/sin of the second half repeat the first half's.
    tl.store(ptr1, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptr2, (x2f * cos[None, :] + x1f * sin[None, :]).to(x2.dtype), mask=mask)


def _rotary_launch(x: torch.Tensor, positions: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[1]
    assert 2 * half <= head_dim, (cos.shape, head_dim)
    assert x.stride(-1) == 1, "rotary needs a contiguous head_dim (it works in place)"
    if num_tokens == 0:
        return
    _rotary_neox_kernel[(num_tokens,)](
        x,
        cos if positions is None else positions,  # unused placeholder without positions
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        NUM_HEADS=num_heads,
        HALF=half,
        BLOCK_H=pow2_at_least(num_heads),
        BLOCK_HALF=pow2_at_least(half),
        HAS_POSITIONS=positions is not None,
    )


def rotary_embedding_neox(
    positions: torch.Tensor | None,  # [num_tokens] int; None: cos/sin rows are already per token
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_position, rotary_dim // 2], e.g. cos(pos * inv_freq); or [num_tokens, ...]
    sin: torch.Tensor,  # [max_position, rotary_dim // 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (HF Llama `rotate_half`) rotary embedding on the first `rotary_dim` dims, in place.

    The model passes `positions=None` with the step's cos/sin rows, looked up once per step and shared by all
    layers."""
    assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1, (cos.shape, sin.shape)
    _rotary_launch(q, positions, cos, sin)
    _rotary_launch(k, positions, cos, sin)
    return q, k


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :I]) * x[..., I:]` for x `[..., 2 * I]` (the fused gate/up projection output)."""
    two_inter = x.shape[-1]
    assert two_inter % 2 == 0, x.shape
    inter = two_inter // 2
    x2 = x.reshape(-1, two_inter)
    assert x2.stride(-1) == 1, "silu_and_mul needs a contiguous last dim"
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    # NOTE: 1024 elements per program: wide enough to be bandwidth bound, narrow enough for many programs per row.
    block = min(1024, pow2_at_least(inter))
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), INTER=inter, BLOCK=block
        )
    return out.view(*x.shape[:-1], inter)
