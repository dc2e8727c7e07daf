from __future__ import annotations

import itertools

import pytest
import torch

from kernels.reference import ref_decode_attention
from kernels.triton import choose_num_splits, decode_attention
from kernels.triton.decode_attention import MAX_SPLITS, MIN_TOKENS_PER_SPLIT
from tests.kernels.conftest import (
    CASE_DTYPES,
    CASE_GROUPS,
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    assert_close,
    boundary_lengths,
    make_paged_cache,
)

# (block_size, head_dim, gqa group, dtype): the full product, with one KV head per group-of-queries test so the
# interpreter stays quick. BLOCK_N is varied alongside: equal to, bigger than and smaller than the cache block.
CASES = [
    pytest.param(bs, hd, g, dt, id=f"bs{bs}-d{hd}-gqa{g}-{DTYPE_IDS[dt]}")
    for bs, hd, g, dt in itertools.product([16, 32], [64, 128], CASE_GROUPS, CASE_DTYPES)
]


def _block_n(block_size: int, head_dim: int) -> int:
    return block_size if head_dim == 64 else {16: 64, 32: 16}[block_size]


def _run(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    num_splits: int | None,
    block_n: int | None,
) -> None:
    kv_cache, tables = make_paged_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(
        q, kv_cache[0], kv_cache[1], tables, lens, scale, max(seq_lens), num_splits=num_splits, block_n=block_n
    )
    assert out.dtype == dtype
    expected = ref_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, scale)
    assert_close("decode_attention", out, expected, dtype)


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype"), CASES)
def test_decode_matches_reference(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    seq_lens = [*boundary_lengths(block_size), 5 * block_size - 2]
    _run(seq_lens, block_size, 1, group, head_dim, dtype, num_splits=1, block_n=_block_n(block_size, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "num_splits", "block_n"), [(16, 2, 16), (32, 5, 16), (16, 8, 32)])
def test_split_k_matches_reference(dtype: torch.dtype, block_size: int, num_splits: int, block_n: int) -> None:
    # Short sequences next to long ones: with 5-8 splits some splits of the short ones are empty and must drop out.
    seq_lens = [1, block_size + 1, 7 * block_size + 5]
    _run(seq_lens, block_size, 2, 4, 64, dtype, num_splits=num_splits, block_n=block_n)


@pytest.mark.parametrize("block_size", [1, 8])
def test_decode_small_block_sizes(block_size: int) -> None:
    # The engine allows any power-of-two block size; tiles then span many blocks (one block-table gather per token).
    _run([1, 9, 8 * block_size + 3], block_size, 2, 3, 64, torch.float32, num_splits=2, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_zero_length_rows_give_zeros(num_splits: int) -> None:
    # seq_len 0 = a padding row (e.g. a CUDA-graph batch padded up): zeros, not NaN, and neighbours unaffected.
    _run([0, 17, 0, 40], 16, 2, 3, 64, torch.float32, num_splits=num_splits, block_n=16)


def test_default_launch_and_strided_output() -> None:
    # Default BLOCK_N and split choice, q and out as strided views of wider tensors (as in the backend).
    seq_lens = [3, 33, 70]
    kv_cache, tables = make_paged_cache(seq_lens, 16, 2, 64, torch.float32)
    qkv = torch.randn(3, 12, 64, device=DEVICE)
    q = qkv[:, :8]
    out_buf = torch.zeros(5, 8, 64, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, 0.1, 70, out=out_buf[1:4])
    expected = ref_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, 0.1)
    assert_close("decode_attention", out_buf[1:4], expected, torch.float32)
    assert not out_buf[0].any() and not out_buf[4].any()


def test_choose_num_splits() -> None:
    sms = 132
    # Enough (sequence, kv head) programs to fill the GPU, or a short context: never split.
    assert choose_num_splits(32, 8, 8192, sms) == 1
    assert choose_num_splits(1, 8, 2 * MIN_TOKENS_PER_SPLIT - 1, sms) == 1
    assert choose_num_splits(0, 8, 8192, sms) == 1
    # One sequence, long context: ~2 programs per SM, each split >= MIN_TOKENS_PER_SPLIT tokens.
    n = choose_num_splits(1, 8, 8192, sms)
    assert 1 < n <= MAX_SPLITS and 8 * n >= sms and 8192 // n >= MIN_TOKENS_PER_SPLIT
    # Bounded by the context: 1024 tokens allow at most 4 splits.
    assert choose_num_splits(1, 8, 1024, sms) == 1024 // MIN_TOKENS_PER_SPLIT
    # More sequences need fewer splits.
    assert choose_num_splits(4, 8, 8192, sms) < n
