"""Paged prefill / extend attention: each chunk's queries attend to their sequence's cached context, causally.

Layout: q `[num_query_tokens, num_heads, head_dim]` (chunks back to back, `query_start_loc` = cu_seqlens, length
`num_chunks + 1`); k_cache, v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`; block_tables
`[num_chunks, max_blocks]`; seq_lens `[num_chunks]` = context length *after* the chunk. The chunk's own K/V must
already be in the cache (the backend runs `store_kv` first), so one loop over the block table covers both the
earlier context and the chunk itself.

Positions: the query at chunk index i of a chunk of length qlen sits at absolute position `seq_len - qlen + i` and
sees key positions `<=` that.

Grid `(num_heads, cdiv(max_query_len, BLOCK_M), num_chunks)`: a program owns BLOCK_M queries of one head of one chunk
and streams key tiles of BLOCK_N tokens up to its last query's position, with an online softmax (fp32, base 2).
"""

from __future__ import annotations

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

# Query rows per program: the default tile, and what `prefill_tile_map` must be built with.
PREFILL_BLOCK_M = 64


# NOTE: the block-table width grows with the longest context of the step: no specialization on it (no recompiles).
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tile_map_ptr,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_TILE_MAP: tl.constexpr,
):
    head = tl.program_id(0)
    if USE_TILE_MAP:  # fixed grid (a CUDA graph): this program's (chunk, query block) is looked up; -1 = no work
        chunk = tl.load(tile_map_ptr + tl.program_id(1) * 2).to(tl.int64)
        m_block = tl.load(tile_map_ptr + tl.program_id(1) * 2 + 1)
        if chunk < 0:
            return
    else:
        m_block = tl.program_id(1)
        chunk = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + chunk)
    q_len = tl.load(query_start_loc_ptr + chunk + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the longest chunk
        return
    seq_len = tl.load(seq_lens_ptr + chunk)
    ctx_len = seq_len - q_len  # tokens cached before this chunk
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    qo_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past this tile's last query are masked for every row, so stop there. Every row (padding rows included,
    # whose q_pos only grows) sees key 0, so no row is all -inf and the softmax never divides 0 by 0.
    end = ctx_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    block_table = block_tables_ptr + chunk * stride_bt
    # NOTE: one loop with the causal mask on every tile, rather than a mask-free loop over the old context plus a
    # masked diagonal loop: simpler, and the few elementwise ops are cheap next to the two dots per tile.
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        block = tl.load(block_table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_ptrs = k_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptrs + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        s = mma(q, k, DOT_FP32) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptrs + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new

    o = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qo_mask)


def prefill_attention(
    q: torch.Tensor,  # [num_query_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_chunks, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_chunks] int32, context length after the chunk
    query_start_loc: torch.Tensor,  # [num_chunks + 1] int32, cu_seqlens of the queries
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_query_tokens, num_heads, head_dim]
    block_m: int | None = None,  # queries per program (power of two >= 16); None = 64
    block_n: int | None = None,  # keys per tile (power of two >= 16); None = 64
    num_warps: int | None = None,  # None = triton's default (4)
    tile_map: torch.Tensor | None = None,  # [num_tiles, 2] int32 (chunk, query block), from `prefill_tile_map`
) -> torch.Tensor:
    """Causal attention of every chunk's queries over their paged context. Returns `out`.

    With `tile_map` the grid is `(num_heads, num_tiles)` whatever the chunks' lengths (what a CUDA graph needs: its
    grid is frozen at capture); each program reads its chunk and query block from the map, rows with chunk -1 do
    nothing, and `max_query_len` is not used. The map must be built with the same `block_m`.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    # NOTE: no quantised (fp8) cache yet: tl.dot needs both operands in one dtype.
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    num_chunks = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_chunks + 1, (query_start_loc.shape, num_chunks)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1, (out.shape, out.stride())
    if num_tokens == 0 or num_chunks == 0 or (max_query_len == 0 and tile_map is None):
        return out
    q, k_cache, v_cache = last_dim_contiguous(q), last_dim_contiguous(k_cache), last_dim_contiguous(v_cache)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    # NOTE: 64x64 tiles, 4 warps: an H100 sweep (docs/kernels.md) found no tile faster on every case.
    # NOTE: one program per *query* head: the GQA group re-reads the same K/V tile, but from L2 (programs of a group
    # are adjacent: heads are grid axis 0, the fastest-varying). Prefill is compute bound, so folding the group into
    # the M dimension would buy little here.
    block_m = check_block_size("block_m", block_m or PREFILL_BLOCK_M)
    block_n = check_block_size("block_n", block_n or 64)
    if tile_map is None:
        grid: tuple[int, ...] = (num_heads, triton.cdiv(max_query_len, block_m), num_chunks)
    else:
        assert tile_map.dtype == torch.int32 and tile_map.shape[1:] == (2,) and tile_map.is_contiguous(), tile_map.shape
        grid = (num_heads, tile_map.shape[0])
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        query_start_loc if tile_map is None else tile_map,  # unread without the map
        out,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *paged_cache_strides(k_cache, v_cache),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=pow2_at_least(head_dim, 16),
        DOT_FP32=use_fp32_dot(q),
        USE_TILE_MAP=tile_map is not None,
        **({"num_warps": num_warps} if num_warps else {}),
    )
    return out


def prefill_num_tiles(max_tokens: int, max_chunks: int, block_m: int = PREFILL_BLOCK_M) -> int:
    """Query blocks of at most `max_tokens` query rows split into at most `max_chunks` chunks: each chunk's last block
    may be partial, so at most `cdiv(max_tokens, block_m) + max_chunks - 1` (the tile map's length for a graph)."""
    return triton.cdiv(max_tokens, block_m) + max(max_chunks - 1, 0)


def prefill_tile_map(query_start_loc: torch.Tensor, num_tiles: int, block_m: int = PREFILL_BLOCK_M) -> torch.Tensor:
    """The `[num_tiles, 2]` int32 (chunk, query block) map of `prefill_attention(..., tile_map=)`: chunk i's
    `cdiv(q_len_i, block_m)` blocks in order, then rows of chunk -1. Device-side torch ops only (no host sync), so a
    CUDA graph recomputes it from the step's query starts on every replay. Tiles past `num_tiles` are dropped: size
    it with `prefill_num_tiles`."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles = torch.div(q_lens + (block_m - 1), block_m, rounding_mode="floor")
    ends = torch.cumsum(tiles, 0)
    t = torch.arange(num_tiles, device=query_start_loc.device, dtype=ends.dtype)
    chunk = torch.searchsorted(ends, t, right=True)  # the first chunk whose tiles end past t
    valid = chunk < q_lens.shape[0]
    chunk = chunk.clamp(max=max(q_lens.shape[0] - 1, 0))
    m_block = t - (ends[chunk] - tiles[chunk]) if q_lens.shape[0] else t
    return torch.stack((torch.where(valid, chunk, -1), torch.where(valid, m_block, 0)), 1).to(torch.int32)
