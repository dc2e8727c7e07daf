from __future__ import annotations

import os

import pytest
import torch

from kernels.reference import ref_store_kv
from kernels.triton import store_kv
from tests.kernels.conftest import DEVICE, DTYPES


def test_kernels_are_interpreted_without_cuda() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton.store_kv import _store_kv_kernel

    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(_store_kv_kernel, InterpretedFunction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 128)])
def test_store_kv_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int) -> None:
    num_blocks, num_tokens = 6 + 40 // block_size, max(2 * block_size + 3, 20)
    # k/v as strided views into a fused qkv projection, as the model produces them.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 3 * num_kv_heads :]
    # Distinct slots scattered over shuffled blocks, a few of them -1 (padding) that must leave the cache alone.
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[torch.randperm(num_tokens)[:4]] = -1
    slot_mapping = slots.to(torch.int64).to(DEVICE)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    expected = kv_cache.clone()

    store_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)
    ref_store_kv(k, v, expected[0], expected[1], slot_mapping)

    # A copy is exact: no tolerance.
    assert torch.equal(kv_cache, expected)


def test_store_kv_all_skipped_and_empty() -> None:
    kv_cache = torch.randn(2, 2, 16, 2, 64, device=DEVICE)
    before = kv_cache.clone()
    k = torch.randn(3, 2, 64, device=DEVICE)
    store_kv(k, k, kv_cache[0], kv_cache[1], torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    store_kv(k[:0], k[:0], kv_cache[0], kv_cache[1], torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(kv_cache, before)
