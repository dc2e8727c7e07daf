"""A step's attention metadata from the persistent batch: the decode-only shortcut against the general path."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.sampling_params import SamplingParams
from engine_core.worker.attention_inputs import attention_metadata, decode_metadata, general_metadata
from engine_core.worker.input_batch import InputBatch

BS = 4


def to_host(name: str, values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values)


def random_batch(rng: np.random.Generator, rows: int) -> tuple[InputBatch, list[int]]:
    batch = InputBatch(max_rows=8, max_model_len=64, max_blocks_per_seq=16, block_size=BS)
    seq_ids = [int(s) for s in rng.permutation(100)[:rows]]
    for seq_id in seq_ids:
        n = int(rng.integers(2, 60))
        blocks = [int(b) for b in rng.permutation(64)[: -(-n // BS)]]
        batch.add(seq_id, rng.integers(0, 1000, n).tolist(), 1, blocks, n - 1, SamplingParams())
    return batch, seq_ids


def assert_same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for f in fields(AttentionMetadata):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f.name
        else:
            assert type(x) is type(y) and x == y, f.name


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("seed", range(3))
def test_a_decode_only_step_gets_the_general_paths_metadata(rows: int, seed: int) -> None:
    batch, seq_ids = random_batch(np.random.default_rng(seed), rows)
    inputs = batch.prepare(seq_ids, [1] * rows)
    fast = decode_metadata(inputs, batch, BS, to_host)
    assert_same(fast, general_metadata(inputs, batch, BS, to_host, full_width=False))
    assert_same(attention_metadata(inputs, batch, BS, to_host, full_width=False), fast)
    assert fast.num_decodes == rows and fast.num_prefills == 0 and fast.num_tokens == rows
    # each row's context is its computed count + the new token; the tables as wide as the longest needs
    assert fast.decode_seq_lens.tolist() == (inputs.num_computed + 1).tolist()
    assert fast.decode_block_tables.shape[1] == -(-int(fast.max_decode_seq_len) // BS)


def test_a_step_with_a_prefill_chunk_takes_the_general_path() -> None:
    batch, seq_ids = random_batch(np.random.default_rng(7), 3)
    batch.add(200, [5] * 9, 9, [60, 61, 62], 0, SamplingParams())
    inputs = batch.prepare([*seq_ids, 200], [1, 1, 1, 9])
    meta = attention_metadata(inputs, batch, BS, to_host, full_width=False)
    assert_same(meta, general_metadata(inputs, batch, BS, to_host, full_width=False))
    assert meta.num_decodes == 3 and meta.num_prefills == 1 and meta.prefill_query_lens_cpu == [9]
