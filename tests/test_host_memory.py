"""The CPU KV cache's memory: zeros without writing them, one mapping, and a budget the host cannot hold refused."""

from __future__ import annotations

import pytest
import torch

from engine_core.worker import host_memory
from engine_core.worker.host_memory import available_host_bytes, zeroed_host_tensor


def test_zeroed_host_tensor_is_zero_contiguous_and_writable() -> None:
    t = zeroed_host_tensor((3, 2, 5, 7), torch.float32, "kv_cache_memory")
    assert t.shape == (3, 2, 5, 7) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0  # page-aligned: vector loads never straddle the mapping's start
    assert torch.count_nonzero(t) == 0
    layers = list(t.unbind(0))
    layers[1].fill_(2.5)
    assert torch.count_nonzero(layers[0]) == 0 and torch.count_nonzero(layers[2]) == 0
    assert bool((t[1] == 2.5).all())


def test_the_mapping_outlives_the_function_that_made_it() -> None:
    layers = list(zeroed_host_tensor((4, 1024), torch.float32, "kv_cache_memory").unbind(0))
    layers[3].copy_(torch.arange(1024, dtype=torch.float32))
    del layers[:3]
    assert layers[0][1023].item() == 1023.0


def test_a_budget_larger_than_the_host_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        zeroed_host_tensor((1 << 20,), torch.float32, "kv_cache_memory")  # 4 MiB > 1 MiB left


def test_available_host_bytes_reads_this_host() -> None:
    free = available_host_bytes()
    assert free is None or free > 0
