"""The native paged decode attention kernel (kernels/cpu/paged_attention.cpp) against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu as cpu_kernels
from kernels.reference import ref_decode_attention
from tests.kernels.conftest import make_cpu_paged_cache

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")


def _run(
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
    strided_q: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    cache, tables = make_cpu_paged_cache(seq_lens, block_size, kv_heads, head_dim, gen)
    heads = kv_heads * group
    if strided_q:  # q as the first part of a fused qkv projection output
        q = torch.randn(len(seq_lens), heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]
    else:
        q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    got = cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale)
    want = ref_decode_attention(q.double(), cache[0].double(), cache[1].double(), tables, lens, scale)
    torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)
    return got, (q, cache, tables, lens)


# Lengths: empty, shorter than one 16-row chunk, exactly one, one past it, and several blocks with a partial tail.
LENS = [0, 1, 15, 16, 17, 33, 100, 250]


@pytest.mark.parametrize("head_dim", [64, 128, 80, 8, 20])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [1, 8, 16, 64])
def test_matches_a_float64_reference(head_dim: int, group: int, block_size: int) -> None:
    # AVX-512: head dims 64 and 128 take the vector path (16-row chunks scored at once, grouped V accumulation), the
    # others the portable one. AVX2: multiples of 8 are scored and multiples of 16 accumulated in vectors, so 8 is
    # half portable and 20 wholly. Blocks of 1 and 8 tokens cut every chunk short. Eight sequences on 3 KV heads:
    # whole-sequence work items at 2 threads; the single-sequence cases below share one sequence's walks.
    _run(LENS, block_size, 3, group, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_one_long_sequence(head_dim: int, kv_heads: int) -> None:
    _run([1000], 16, kv_heads, 3, head_dim)


def test_the_same_bits_for_any_thread_count() -> None:
    # 1 thread: whole sequences; 3 threads with 4 sequences: one KV head per work item. Same arithmetic either way.
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run([300, 17, 64, 5], 16, 3, 3, 64, seed=5)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_a_lone_sequence_the_same_bits_for_any_thread_count() -> None:
    # 1 thread: the sequence is one work item over whole K/V rows; 2 and 3 threads: `attend_lone` shares its walks
    # (AVX-512 and AVX2 builds; one KV head per work item elsewhere).
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(_run([190], 16, 3, 3, 64, seed=7)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_strided_q_and_out() -> None:
    got, (q, cache, tables, lens) = _run([40, 0, 70], 16, 3, 3, 64, strided_q=True)
    out = torch.full(q.shape, 7.0)
    cpu_kernels.paged_decode_attention(q, cache, tables, lens, 64**-0.5, out=out)
    assert torch.equal(out, got)
    assert (got[1] == 0).all()  # a zero-length row gives zeros


@settings(max_examples=25, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 300), min_size=1, max_size=9),
    block_size=st.sampled_from([1, 8, 16, 32]),
    group=st.sampled_from([1, 3, 4, 8]),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([64, 128, 40]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    seq_lens: list[int], block_size: int, group: int, kv_heads: int, head_dim: int, seed: int
) -> None:
    _run(seq_lens, block_size, kv_heads, group, head_dim, seed=seed, strided_q=seed % 2 == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_prefetching_walk_reads_only_each_sequences_blocks(dtype: torch.dtype, threads: int) -> None:
    # Whole-sequence work items (8 sequences >= 2 per thread) prefetch the next block of their K walk and, past its
    # end, the V walk's first blocks. Every table entry past a sequence's blocks points at a NaN block, and the last
    # block of each sequence is partly NaN past its length: a walk (or a prefetch turned into a read) that strays
    # past the sequence's rows poisons its output.
    bs, lens = 16, [1, 15, 16, 17, 35, 48, 64, 130]
    gen = torch.Generator().manual_seed(3)
    cache, tables = make_cpu_paged_cache(lens, bs, 3, 64, gen)
    ref_tables = tables.clone()  # entries past each sequence's blocks: -1
    poison = min(set(range(cache.shape[1])) - set(tables[tables >= 0].tolist()))  # one of the 3 spare blocks
    cache[:, poison] = float("nan")
    for i, n in enumerate(lens):
        tables[i, -(-n // bs) :] = poison
        cache[:, tables[i, (n - 1) // bs], n % bs if n % bs else bs :] = float("nan")
    cache = cache.to(dtype)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = cpu_kernels.paged_decode_attention(q, cache, tables, seq_lens, 0.125)
    finally:
        torch.set_num_threads(saved)
    clean = cache.double().nan_to_num(0.0)
    want = ref_decode_attention(q.double(), clean[0], clean[1], ref_tables, seq_lens, 0.125)
    assert torch.isfinite(got).all()
    tol = 1e-5 if dtype == torch.float32 else 2**-8 * clean[1].abs().max().item()
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0 if dtype == torch.bfloat16 else 1e-5)


def test_bad_inputs_are_rejected() -> None:
    cache = torch.zeros(2, 2, 4, 1, 64)
    q = torch.randn(1, 2, 64)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_decode_attention(q, cache, torch.tensor([[5]], dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="seq_len exceeds the block table"):
        cpu_kernels.paged_decode_attention(
            q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32), 1.0
        )
    with pytest.raises(RuntimeError, match="q and out must be float32"):
        cpu_kernels.paged_decode_attention(q.double(), cache, torch.zeros(1, 1, dtype=torch.int32), lens, 1.0)
    with pytest.raises(RuntimeError, match="the KV cache must be float32 or bfloat16"):
        cpu_kernels.paged_decode_attention(q, cache.double(), torch.zeros(1, 1, dtype=torch.int32), lens, 1.0)
