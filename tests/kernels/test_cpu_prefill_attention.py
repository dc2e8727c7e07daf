"""The native paged prefill attention kernel (kernels/cpu/prefill_attention.cpp) against a float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.cpu_backend import CpuAttentionBackend
from kernels import cpu as cpu_kernels
from kernels.reference import ref_decode_attention, ref_prefill_attention
from tests.kernels.conftest import make_cpu_paged_cache

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")


def _run(
    chunks: list[tuple[int, int]],  # (cached context before the chunk, chunk length)
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
    strided_q: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [ctx + qlen for ctx, qlen in chunks]
    cache, tables = make_cpu_paged_cache(seq_lens, block_size, kv_heads, head_dim, gen)
    qlens = [qlen for _, qlen in chunks]
    starts = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32)
    heads = kv_heads * group
    if strided_q:  # q as the first part of a fused qkv projection output
        q = torch.randn(sum(qlens), heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]
    else:
        q = torch.randn(sum(qlens), heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_prefill_attention(q, cache, tables, lens, starts, scale)
    want = ref_prefill_attention(q.double(), cache[0].double(), cache[1].double(), tables, lens, starts, scale)
    torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
    return got, (q, cache, tables, lens, starts)


@pytest.mark.parametrize("head_dim", [64, 128, 80, 8, 40])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_matches_a_float64_reference(head_dim: int, group: int, block_size: int) -> None:
    # Fresh prefills and extends, across block and tile boundaries, a zero-length chunk, chunks shorter and longer
    # than one work item's query block. Head dims of 80 and 40 leave partial column blocks; 8 (the tiny test models)
    # is narrower than one vector.
    chunks = [(0, 1), (0, 70), (block_size, 1), (0, 0), (3, 2 * block_size + 3), (130, 37), (0, 200)]
    _run(chunks, block_size, 2, group, head_dim)


def test_strided_q_and_rows_past_the_chunks_left_untouched() -> None:
    got, (q, cache, tables, lens, starts) = _run([(5, 40), (0, 0), (61, 9)], 16, 3, 3, 64, strided_q=True)
    t = q.shape[0]
    q2 = torch.cat((q, torch.randn(2, *q.shape[1:])))  # two padding rows that belong to no chunk
    out = torch.full(q2.shape, 7.0)
    cpu_kernels.paged_prefill_attention(q2, cache, tables, lens, starts, 64**-0.5, out=out)
    assert torch.equal(out[:t], got) and (out[t:] == 7.0).all()


def test_the_same_bits_for_any_thread_count() -> None:
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run([(0, 150), (300, 64), (0, 7)], 16, 3, 3, 64, seed=5)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 150), st.integers(0, 120)), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 8, 16, 32]),
    group=st.sampled_from([1, 3, 4, 8]),
    kv_heads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_random_batches(chunks: list[tuple[int, int]], block_size: int, group: int, kv_heads: int, seed: int) -> None:
    if all(ctx + qlen == 0 for ctx, qlen in chunks):
        chunks = [(0, 1)]
    chunks = [(ctx, qlen) if ctx + qlen else (0, 1) for ctx, qlen in chunks]
    _run(chunks, block_size, kv_heads, group, 64, seed=seed, strided_q=seed % 2 == 1)


def test_bad_inputs_are_rejected() -> None:
    cache = torch.zeros(2, 2, 4, 1, 64)
    q = torch.randn(3, 2, 64)
    starts = torch.tensor([0, 3], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_prefill_attention(q, cache, torch.tensor([[5]], dtype=torch.int32), lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="query_start_loc / seq_lens out of range"):
        cpu_kernels.paged_prefill_attention(
            q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([2], dtype=torch.int32), starts, 1.0
        )
    with pytest.raises(RuntimeError, match="q and out must be float32"):
        cpu_kernels.paged_prefill_attention(q.double(), cache, torch.zeros(1, 1, dtype=torch.int32), lens, starts, 1.0)
    with pytest.raises(RuntimeError, match="the KV cache must be float32 or bfloat16"):
        cpu_kernels.paged_prefill_attention(q, cache.double(), torch.zeros(1, 1, dtype=torch.int32), lens, starts, 1.0)


def test_backend_forward_mixes_decode_rows_and_prefill_chunks() -> None:
    """The `cpu` backend: store_kv of the step's tokens, decode rows first, then prefill chunks, then padding rows."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d, bs = 6, 2, 64, 16
    decode_lens, chunks = [9, 40], [(0, 21), (33, 5)]  # (context, chunk length)
    seq_lens = decode_lens + [c + q for c, q in chunks]
    cache, tables = make_cpu_paged_cache(seq_lens, bs, kv_heads, d, gen)
    nd, qlens = len(decode_lens), [q for _, q in chunks]
    # Slots of the step's new tokens: each decode row's last position, each chunk's last qlen positions.
    positions = [(i, n - 1) for i, n in enumerate(decode_lens)]
    positions += [(nd + i, c + t) for i, (c, q) in enumerate(chunks) for t in range(q)]
    slots = [int(tables[s, p // bs]) * bs + p % bs for s, p in positions] + [-1]  # and one padding row
    n = len(slots)
    q = torch.randn(n, heads, d, generator=gen)
    k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
    meta = AttentionMetadata(
        num_decodes=nd,
        num_prefills=len(chunks),
        slot_mapping=torch.tensor(slots),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32),
        decode_block_tables=tables[:nd],
        max_decode_seq_len=max(decode_lens),
        prefill_query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32),
        prefill_seq_lens=torch.tensor(seq_lens[nd:], dtype=torch.int32),
        prefill_block_tables=tables[nd:],
        max_prefill_query_len=max(qlens),
        prefill_query_lens_cpu=qlens,
        prefill_seq_lens_cpu=seq_lens[nd:],
    )
    backend = CpuAttentionBackend(heads, kv_heads, d, bs, d**-0.5)
    backend.prepare(meta)
    got = backend.forward(q, k, v, cache, meta)
    m = meta
    want_dec = ref_decode_attention(q[:nd], cache[0], cache[1], m.decode_block_tables, m.decode_seq_lens, d**-0.5)
    torch.testing.assert_close(got[:nd], want_dec, atol=1e-5, rtol=1e-5)
    want_pre = ref_prefill_attention(
        q[nd:-1], cache[0], cache[1], m.prefill_block_tables, m.prefill_seq_lens, m.prefill_query_start_loc, d**-0.5
    )
    torch.testing.assert_close(got[nd:-1], want_pre, atol=1e-5, rtol=1e-5)
    assert not got[-1].any()
