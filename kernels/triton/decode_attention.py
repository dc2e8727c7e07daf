"""Paged decode attention: one query token per sequence attends to its whole cached context.

Layout: q `[batch, num_heads, head_dim]`; k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`;
block_tables `[batch, max_blocks]` (physical block ids, any order); seq_lens `[batch]` (context length, including the
new token whose K/V is already in the cache).

Grid `(batch, num_kv_heads, num_splits)`: a program owns one KV head and the whole GQA group of query heads that read
it (rows of a `[BLOCK_H, head_dim]` tile), so each K/V tile is loaded from HBM once per group rather than once per
query head. It streams its context range in `BLOCK_N`-token tiles, gathering each token's physical block id from the
block table, with an online (running max / running sum) softmax in fp32 and base-2 exponentials.

Split-K (flash-decoding): with few (sequence, kv head) pairs the GPU would sit mostly idle while a handful of
programs walk long contexts, so the context is cut into `num_splits` ranges processed in parallel (grid axis 2); each
writes its normalised partial output and log-sum-exp (fp32), and `_decode_reduce_kernel` (grid `(batch, num_heads)`)
merges them. `choose_num_splits` picks the split count.

No recompiles while sequences grow: the split count and the block-table width are runtime arguments that triton does
not specialize on (`do_not_specialize`), and everything that is `constexpr` depends on the model and the engine
config only, plus whether the step splits at all. So a whole run compiles at most two decode variants and one
reduce variant (`plan_decode` returns exactly what selects the variant; tests/kernels check it stays in that set).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import (
    LOG2E,
    check_block_size,
    last_dim_contiguous,
    mma,
    paged_cache_strides,
    pow2_at_least,
    use_fp32_dot,
)

# NOTE: a split below ~256 tokens costs more in partial-result traffic and the reduce launch than it wins in
# parallelism; 64 splits bounds the partial buffers. Both are plain engineering guesses, easy to retune on a GPU.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
_DEFAULT_NUM_SMS = 132  # H100 SXM; used when there is no CUDA device (interpreter).
# NOTE: 64 tokens per tile keeps a [64, 128] bf16 K tile (16 KiB) in flight per program; tl.dot needs N >= 16.
DEFAULT_BLOCK_N = 64
# Splits merged per step of the reduce kernel's loop (a fixed tile, so the split count can stay a runtime value).
_REDUCE_BLOCK_S = 16
# Runtime integers that change while sequences grow: triton must not specialize on them (value 1, divisibility by
# 16), or each new value class would compile another variant mid-generation.
DECODE_DO_NOT_SPECIALIZE = ("stride_bt", "num_splits")


@triton.jit(do_not_specialize=DECODE_DO_NOT_SPECIALIZE)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    num_splits,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PARTIALS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP  # rows past the GQA group are padding for tl.dot's M >= 16
    d_mask = offs_d < HEAD_DIM
    q_heads = kv_head * GROUP + offs_h
    qo_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)

    if USE_PARTIALS:
        # Per-sequence split length, rounded to whole tiles, so short sequences in the batch split evenly too.
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
    else:
        start = 0
        end = seq_len

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        # NOTE: BLOCK_SIZE is a constexpr power of two, so these are a shift and a mask, not integer divisions.
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = d_mask[:, None] & n_mask[None, :]
        # K is loaded transposed ([head_dim, BLOCK_N]) straight from the cache, so the dot needs no tl.trans.
        k_ptrs = k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptrs + offs_d[:, None], mask=kv_mask, other=0.0)
        s = mma(q, k, DOT_FP32) * scale_log2  # [BLOCK_H, BLOCK_N], log2 domain
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptrs + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        # NOTE: P is rounded to V's dtype before P @ V, as every flash-attention kernel does for tensor cores.
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    # An empty range (seq_len == 0 padding row, or a split past the end of a short sequence) has l_i == 0: emit zeros
    # and lse = -inf instead of 0/0.
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if USE_PARTIALS:
        # Partials are contiguous fp32: out [batch, heads, num_splits, HEAD_DIM], lse [batch, heads, num_splits].
        row = (seq * NUM_HEADS + q_heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=qo_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)
    else:
        o_ptrs = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (seq * NUM_HEADS + head) * num_splits
    # Pass 1: the largest lse over all splits (lse is tiny next to the partial outputs).
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_mask = s0 + offs_s < num_splits
        m_vec = tl.maximum(m_vec, tl.load(part_lse_ptr + base + s0 + offs_s, mask=s_mask, other=float("-inf")))
    m = tl.max(m_vec, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (seq_len == 0): weights become 0, output 0
    # Pass 2: the lse-weighted sum of the partial outputs. Masked rows load 0 (not garbage that could be NaN, which
    # a zero weight would not cancel).
    acc = tl.zeros([BLOCK_D], tl.float32)
    w_vec = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_mask = s0 + offs_s < num_splits
        rows = base + s0 + offs_s
        w = tl.exp2(tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf")) - m)
        o = tl.load(
            part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
        )
        acc += tl.sum(o * w[:, None], 0)
        w_vec += w
    w_sum = tl.sum(w_vec, 0)
    o = acc / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = _DEFAULT_NUM_SMS) -> int:
    """Flash-decoding heuristic: split the context only when (batch x kv heads) programs cannot fill the GPU.

    Aim for ~2 programs per SM, but never make a split shorter than MIN_TOKENS_PER_SPLIT tokens.
    """
    programs = batch * num_kv_heads
    if programs == 0 or programs >= num_sms or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


@dataclass(frozen=True)
class DecodePlan:
    """One decode launch: the grid's split count (a runtime value) and the compile-time constants, which alone pick
    the compiled variant of `_decode_kernel` (with the dtypes)."""

    num_splits: int
    constexprs: tuple[tuple[str, int | bool], ...]


def plan_decode(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_seq_len: int,
    dot_fp32: bool,
    num_sms: int = _DEFAULT_NUM_SMS,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> DecodePlan:
    """The split count (`choose_num_splits` unless given) and the kernel's constexprs for one decode launch."""
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_block_size("block_n", DEFAULT_BLOCK_N if block_n is None else block_n)
    check_block_size("block_size", block_size, minimum=1)
    group = num_heads // num_kv_heads
    constexprs = (
        ("BLOCK_SIZE", block_size),
        ("GROUP", group),
        ("HEAD_DIM", head_dim),
        ("NUM_HEADS", num_heads),
        ("BLOCK_H", pow2_at_least(group, 16)),
        ("BLOCK_D", pow2_at_least(head_dim, 16)),
        ("BLOCK_N", DEFAULT_BLOCK_N if block_n is None else block_n),
        ("USE_PARTIALS", num_splits > 1),
        ("DOT_FP32", dot_fp32),
    )
    return DecodePlan(num_splits, constexprs)


def decode_attention(
    q: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim]; any strides with a contiguous head_dim
    num_splits: int | None = None,  # None = choose_num_splits
    block_n: int | None = None,  # context tokens per tile (power of two >= 16); None = DEFAULT_BLOCK_N
) -> torch.Tensor:
    """Attention of each sequence's single query token over its paged context. Returns `out`.

    `max_seq_len` only feeds the split heuristic; a fixed `num_splits` (as a CUDA graph needs: its grid is frozen at
    capture) is correct for any context length, since each sequence divides its own context.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    # NOTE: no quantised (fp8) cache yet: tl.dot needs both operands in one dtype.
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    plan = plan_decode(
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        max_seq_len,
        use_fp32_dot(q),
        _num_sms(q.device),
        num_splits,
        block_n,
    )
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1, (out.shape, out.stride())
    if batch == 0:
        return out
    q, k_cache, v_cache = last_dim_contiguous(q), last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    splits = plan.num_splits
    if splits == 1:
        part_out = part_lse = out  # unused placeholders
    else:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *paged_cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        splits,
        **dict(plan.constexprs),
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            HEAD_DIM=head_dim,
            NUM_HEADS=num_heads,
            BLOCK_S=_REDUCE_BLOCK_S,
            BLOCK_D=pow2_at_least(head_dim, 16),
        )
    return out
