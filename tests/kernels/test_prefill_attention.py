from __future__ import annotations

import itertools

import pytest
import torch

from kernels.reference import ref_prefill_attention
from kernels.triton import prefill_attention, prefill_num_tiles, prefill_tile_map
from tests.kernels.conftest import CASE_DTYPES, CASE_GROUPS, DEVICE, DTYPE_IDS, DTYPES, assert_close, make_paged_cache

# (block_size, head_dim, gqa group, dtype): the full product, one KV head. BLOCK_M/BLOCK_N vary alongside.
CASES = [
    pytest.param(bs, hd, g, dt, id=f"bs{bs}-d{hd}-gqa{g}-{DTYPE_IDS[dt]}")
    for bs, hd, g, dt in itertools.product([16, 32], [64, 128], CASE_GROUPS, CASE_DTYPES)
]


def _chunks(block_size: int) -> list[tuple[int, int]]:
    """(cached context before the chunk, chunk length): fresh prefills and extends, across block boundaries."""
    return [(0, 1), (0, block_size + 1), (block_size, 1), (3, 2 * block_size + 3), (2 * block_size + 3, 5)]


def _run(
    chunks: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_m: int | None,
    block_n: int | None,
) -> None:
    seq_lens = [ctx + qlen for ctx, qlen in chunks]
    kv_cache, tables = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    qlens = [qlen for _, qlen in chunks]
    starts = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(qlens), num_kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = prefill_attention(
        q, kv_cache[0], kv_cache[1], tables, lens, starts, scale, max(qlens), block_m=block_m, block_n=block_n
    )
    assert out.dtype == dtype
    expected = ref_prefill_attention(q, kv_cache[0], kv_cache[1], tables, lens, starts, scale)
    assert_close("prefill_attention", out, expected, dtype)


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype"), CASES)
def test_prefill_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    # Tiles smaller than, equal to and larger than the cache block; BLOCK_M != BLOCK_N for some.
    block_m, block_n = {(16, 64): (16, 16), (16, 128): (32, 64), (32, 64): (16, 32), (32, 128): (32, 16)}[
        (block_size, head_dim)
    ]
    _run(_chunks(block_size), block_size, 1, group, head_dim, dtype, block_m, block_n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_two_kv_heads_default_tiles(dtype: torch.dtype) -> None:
    # Several KV heads (query head -> KV head mapping), default 64x64 tiles, a chunk longer than one BLOCK_M.
    _run([(0, 70), (20, 3), (45, 33)], 16, 2, 3, 64, dtype, None, None)


@pytest.mark.parametrize("block_size", [1, 8])
def test_prefill_small_block_sizes(block_size: int) -> None:
    _run([(0, 9), (2 * block_size + 1, 17)], block_size, 2, 2, 64, torch.float32, 16, 16)


def test_prefill_empty_chunk_and_strided_output() -> None:
    # A zero-length chunk in the middle must be skipped; q/out as strided views of wider tensors.
    chunks = [(5, 4), (9, 0), (0, 17)]
    seq_lens = [ctx + qlen for ctx, qlen in chunks]
    kv_cache, tables = make_paged_cache(seq_lens, 16, 1, 64, torch.float32)
    starts = torch.tensor([0, 4, 4, 21], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(21, 6, 64, device=DEVICE)[:, 1:3]
    out_buf = torch.zeros(23, 2, 64, device=DEVICE)
    prefill_attention(q, kv_cache[0], kv_cache[1], tables, lens, starts, 0.2, 17, out=out_buf[1:22], block_m=16)
    expected = ref_prefill_attention(q, kv_cache[0], kv_cache[1], tables, lens, starts, 0.2)
    assert_close("prefill_attention", out_buf[1:22], expected, torch.float32)
    assert not out_buf[0].any() and not out_buf[22].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_tile_map_grid_equals_the_plain_grid(dtype: torch.dtype) -> None:
    """The fixed grid of a CUDA graph (`tile_map`, absolute query starts after 3 rows that no chunk owns, empty
    chunks past the real ones, spare tiles of chunk -1) computes what the plain grid computes, bit for bit, and
    leaves rows outside the chunks alone."""
    chunks = [(0, 70), (20, 3), (45, 33)]
    seq_lens = [ctx + qlen for ctx, qlen in chunks]
    kv_cache, tables = make_paged_cache(seq_lens, 16, 2, 64, dtype)
    starts = torch.tensor([0, 70, 73, 106], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(106, 6, 64, dtype=dtype, device=DEVICE)
    plain = prefill_attention(q, kv_cache[0], kv_cache[1], tables, lens, starts, 0.125, 70)
    # Two more (empty) chunks, and every query row shifted past 3 foreign rows.
    pad_tables = torch.cat([tables, torch.zeros(2, tables.shape[1], dtype=torch.int32, device=DEVICE)])
    pad_lens = torch.cat([lens, torch.tensor([99, 99], dtype=torch.int32, device=DEVICE)])
    abs_starts = torch.cat([starts, starts[-1:], starts[-1:]]) + 3
    num_tiles = prefill_num_tiles(128, 5)
    tile_map = prefill_tile_map(abs_starts, num_tiles)
    assert tile_map[:, 0].tolist()[:4] == [0, 0, 1, 2] and (tile_map[4:, 0] == -1).all()
    q_all = torch.cat(
        [torch.randn(3, 6, 64, dtype=dtype, device=DEVICE), q, torch.randn(7, 6, 64, device=DEVICE).to(dtype)]
    )
    out = torch.full_like(q_all, 7.0)
    prefill_attention(
        q_all, kv_cache[0], kv_cache[1], pad_tables, pad_lens, abs_starts, 0.125, 0, out=out, tile_map=tile_map
    )
    assert torch.equal(out[3:109], plain)
    assert (out[:3] == 7).all() and (out[109:] == 7).all()
