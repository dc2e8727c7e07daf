"""A bf16 KV cache in the native CPU kernels (kv_cache_dtype="bfloat16"): store_kv rounds each K/V to bf16 as torch
does; decode and prefill attention over it run AVX-512 BF16 dot products where the CPU has them (q and the softmax
weights rounded to bf16, stated bounds below), else the float32 kernel over the same values widened to fp32 (the
widening is exact and every product and sum stays fp32; the compiler may order a portable dot product's partial sums
differently per element type, hence float32 ulps, not bits)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.cpu_backend import CpuAttentionBackend
from kernels import cpu as cpu_kernels
from kernels.reference import ref_decode_attention, ref_prefill_attention
from tests.kernels.conftest import make_cpu_paged_cache

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")


def _bf16_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    cache, tables = make_cpu_paged_cache(seq_lens, block_size, kv_heads, head_dim, torch.Generator().manual_seed(seed))
    return cache.bfloat16(), tables


def test_store_kv_rounds_to_bf16_as_torch_does_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 4, 8, 3, 64, dtype=torch.bfloat16)
    # a strided k/v (views into one qkv row) and values whose rounding ties and overflows matter
    kv = torch.randn(5, 6, 64, generator=gen) * 100
    kv[0, 0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -0.0])
    k, v = kv[:, :3], kv[:, 3:]
    slots = torch.tensor([3, 17, -1, 31, 0])
    cpu_kernels.store_kv(cache, k, v, slots)
    flat = cache.view(2, 32, 3, 64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0, s], k[t].bfloat16()) and torch.equal(flat[1, s], v[t].bfloat16())
    written = {s for s in slots.tolist() if s >= 0}
    assert not flat[:, [s for s in range(32) if s not in written]].any()  # the padding row wrote nothing


def _assert_bf16_decode(
    got: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float
) -> None:
    """`got` against the float64 attention over the bf16 cache's values, with the bounds of the path that ran: with
    AVX-512 BF16 (head_dim a multiple of 32, up to 128) up to the rounding of each softmax weight to bf16 (relative
    2^-9, the normalising sum adding the rounded weights: at most 2 * 2^-9 * max|v|; q's two bf16 halves keep ~16
    bits, ~2^-17); otherwise the float32 kernel over the widened values (float32 ulps: a portable dot product's
    partial sums may be ordered differently per element type)."""
    k, v = cache[0].double(), cache[1].double()
    exact = ref_decode_attention(q.double(), k, v, tables, lens, scale).double()
    if not cpu_kernels.decode_bf16_dot_products(q.shape[-1]):
        same_values = cpu_kernels.paged_decode_attention(q, cache.float(), tables, lens, scale)
        torch.testing.assert_close(got, same_values, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.double(), exact, atol=2**-8 * v.abs().max().item(), rtol=0)
    # on average a fraction of a bf16 ulp of the outputs (~1.8e-4 measured; q rounded to bf16 alone gave ~3e-4)
    assert (got.double() - exact).abs().mean() < 2.5e-4


@pytest.mark.parametrize("head_dim", [64, 128, 32, 80])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_over_a_bf16_cache(head_dim: int, group: int, block_size: int) -> None:
    # 64, 128 and 32: the dot products where the CPU has them (16 rows per register of scores, V rows interleaved in
    # pairs; blocks of 1 token cut every chunk to one row, an odd row out); 80: the float32 kernel over the widened
    # values. Lengths: empty, odd, one chunk, one past it, across blocks with a partial tail.
    lens = [0, 1, 15, 16, 17, 31, 33, 100, 250]
    cache, tables = _bf16_cache(lens, block_size, 3, head_dim, seed=head_dim + group)
    q = torch.randn(len(lens), 3 * group, head_dim, generator=torch.Generator().manual_seed(7))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, cache, tables, seq_lens, scale)
    _assert_bf16_decode(got, q, cache, tables, seq_lens, scale)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lens", [[300, 17, 64, 5], [190], [1001]])
def test_decode_over_a_bf16_cache_the_same_bits_for_any_thread_count(head_dim: int, lens: list[int]) -> None:
    # several sequences: whole-sequence work items at 1 thread, one KV head per item at 3; a lone sequence: one item
    # at 1 thread, the shared walks (K by token ranges, V by 32-element slices of head_dim) at 2 and 3
    cache, tables = _bf16_cache(lens, 16, 3, head_dim, seed=len(lens))
    q = torch.randn(len(lens), 9, head_dim, generator=torch.Generator().manual_seed(11))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(cpu_kernels.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    _assert_bf16_decode(results[0], q, cache, tables, seq_lens, head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [64, 128, 80, 40, 8, 9])
@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_over_a_bf16_cache(head_dim: int, block_size: int) -> None:
    """With AVX-512 BF16 and an even head_dim: the float64 attention of q rounded to bf16 (after the scale) over the
    cache's values, up to the rounding of each softmax weight to bf16 (relative 2^-9; the row sums add the rounded
    weights, so the output moves by at most 2 * 2^-9 * max|v|, bounded here by 2^-8 * max|v|). Otherwise (an odd
    head_dim, or a CPU without the instructions) the float32 kernel over the widened tile: the same bits as over a
    float32 cache of the same values."""
    chunks = [(0, 70), (33, 5), (130, 1), (0, 200), (3, 37)]  # tiles past 64 keys, partial tiles, odd key counts
    seq_lens = [c + n for c, n in chunks]
    cache, tables = _bf16_cache(seq_lens, block_size, 2, head_dim, seed=head_dim + block_size)
    qlens = [n for _, n in chunks]
    starts = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    q = torch.randn(sum(qlens), 6, head_dim, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_prefill_attention(q, cache, tables, lens, starts, scale)
    if not _dot_products(head_dim):
        same_values = cpu_kernels.paged_prefill_attention(q, cache.float(), tables, lens, starts, scale)
        assert torch.equal(got, same_values)  # the same micro-kernels over the widened tile: the same bits
    _assert_bf16_prefill(got, q, cache, tables, lens, starts, scale)


def _dot_products(head_dim: int) -> bool:
    return cpu_kernels.prefill_bf16_dot_products() and head_dim % 2 == 0


def _assert_bf16_prefill(
    got: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
) -> None:
    """`got` against float64 references over the bf16 cache's values, with the bounds of the path that ran."""
    k, v = cache[0].double(), cache[1].double()
    exact = ref_prefill_attention(q.double(), k, v, tables, lens, starts, scale).double()
    if not _dot_products(q.shape[-1]):
        torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
        return
    want = ref_prefill_attention((q * scale).bfloat16().double(), k, v, tables, lens, starts, 1.0).double()
    torch.testing.assert_close(got.double(), want, atol=2**-8 * v.abs().max().item(), rtol=0)
    # against the exact attention (q not rounded either), on average: a fraction of a bf16 ulp of the outputs
    assert (got.double() - exact).abs().mean() < 2e-3


def test_the_cpu_backend_writes_and_reads_a_bf16_cache() -> None:
    """One step of the `cpu` backend (a decode row and a prefill chunk) over a bf16 cache: the step's K/V land in the
    cache rounded to bf16, and both kinds of row attend over the rounded values."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs = 6, 2, 64, 16
    cache, tables = _bf16_cache([30, 21], bs, kv_heads, d, seed=9)
    slots = [int(tables[0, 29 // bs]) * bs + 29 % bs] + [int(tables[1, p // bs]) * bs + p % bs for p in range(21)]
    n = len(slots)
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    meta = AttentionMetadata(
        num_decodes=1,
        num_prefills=1,
        slot_mapping=torch.tensor(slots),
        decode_seq_lens=torch.tensor([30], dtype=torch.int32),
        decode_block_tables=tables[:1],
        max_decode_seq_len=30,
        prefill_query_start_loc=torch.tensor([0, 21], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([21], dtype=torch.int32),
        prefill_block_tables=tables[1:],
        max_prefill_query_len=21,
        prefill_query_lens_cpu=[21],
        prefill_seq_lens_cpu=[21],
    )
    backend = CpuAttentionBackend(heads, kv_heads, d, bs, d**-0.5)
    assert "bfloat16" in backend.cache_dtypes
    got = backend.forward(q, k, v, cache, meta)
    flat = cache.view(2, -1, kv_heads, d)
    assert torch.equal(flat[0, slots], k.bfloat16()) and torch.equal(flat[1, slots], v.bfloat16())
    m = meta
    _assert_bf16_decode(got[:1], q[:1], cache, m.decode_block_tables, m.decode_seq_lens, d**-0.5)
    _assert_bf16_prefill(
        got[1:], q[1:], cache, m.prefill_block_tables, m.prefill_seq_lens, m.prefill_query_start_loc, d**-0.5
    )
