"""Reshape-and-cache: write each token's K and V into its paged-cache slot.

Layout: k, v `[num_tokens, num_kv_heads, head_dim]`; k_cache, v_cache `[num_blocks, block_size, num_kv_heads,
head_dim]` (the two halves of the per-layer `[2, ...]` cache). `slot_mapping[t] = block_id * block_size + offset`;
a negative slot (padding) is skipped. Grid: one program per token, covering all of its KV heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.common import last_dim_contiguous, paged_cache_strides, pow2_at_least


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """Write k/v into the paged caches in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape, (k.shape, v.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, k.shape)
    assert slot_mapping.shape[0] == num_tokens, (slot_mapping.shape, num_tokens)
    # The cache is written in place, so it cannot be silently copied: insist on a stride-1 head_dim.
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "kv cache head_dim must be contiguous"
    k, v = last_dim_contiguous(k), last_dim_contiguous(v)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *paged_cache_strides(k_cache, v_cache),
        BLOCK_SIZE=k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=pow2_at_least(num_kv_heads),
        BLOCK_D=pow2_at_least(head_dim),
    )
