"""The worker's persistent batch (InputBatch): rows, step order and per-token inputs, without a model."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from engine_core.sampling_params import SamplingParams
from engine_core.worker.input_batch import InputBatch, StepInputs

BS = 4


def make_batch(rows: int = 4) -> InputBatch:
    return InputBatch(max_rows=rows, max_model_len=32, max_blocks_per_seq=8, block_size=BS)


def test_step_puts_decodes_first_longest_context_first_and_maps_slots() -> None:
    batch = make_batch()
    params = SamplingParams()
    batch.add(10, [1, 2, 3, 4, 5, 6], 6, [7, 3], 0, params)  # prefill of 6 tokens over blocks 7, 3
    batch.add(11, [9, 9, 9], 2, [5], 2, params)  # one decode token at position 2 (context 3)
    batch.add(12, [8] * 6, 5, [1, 2], 5, params)  # one decode token at position 5 (context 6)
    inputs = batch.prepare([10, 11, 12], [6, 1, 1])
    assert inputs.seq_ids == [12, 11, 10] and inputs.num_decodes == 2
    assert inputs.positions.tolist() == [5, 2, 0, 1, 2, 3, 4, 5]
    assert inputs.input_ids.tolist() == [8, 9, 1, 2, 3, 4, 5, 6]
    # slot = block * block_size + offset: seq 12 pos 5 -> block 2, seq 11 pos 2 -> block 5, seq 10 over 7 then 3
    assert inputs.slot_mapping.tolist() == [2 * BS + 1, 5 * BS + 2, 28, 29, 30, 31, 12, 13]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 8] and inputs.sample_mask.tolist() == [True, True, True]


def test_advance_appends_sampled_tokens_and_a_partial_prefill_does_not_sample() -> None:
    batch = make_batch()
    batch.add(1, [4, 5, 6, 7, 8], 5, [0, 1], 0, SamplingParams())
    inputs = batch.prepare([1], [3])  # a chunk: 3 of 5 prompt tokens
    assert inputs.sample_mask.tolist() == [False]
    batch.advance(inputs, np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    inputs = batch.prepare([1], [2])
    assert inputs.positions.tolist() == [3, 4] and inputs.sample_mask.tolist() == [True]
    batch.advance(inputs, inputs.rows, np.array([42]))
    inputs = batch.prepare([1], [1])
    assert inputs.input_ids.tolist() == [42] and inputs.positions.tolist() == [5] and inputs.num_decodes == 1


@pytest.mark.parametrize("seed", range(5))
def test_a_decode_only_step_gets_the_inputs_of_the_per_token_expansion(seed: int) -> None:
    """Decode-only steps take `prepare`'s shortcut (each row's position is its computed count): every input the same
    as the general per-token expansion's, ties in context length kept in scheduler order, a row whose sampled token
    is not yet known (a step planned ahead) not sampling."""
    rng = np.random.default_rng(seed)
    batch = InputBatch(max_rows=8, max_model_len=64, max_blocks_per_seq=16, block_size=BS)
    seq_ids = [int(s) for s in rng.permutation(100)[:6]]
    for seq_id in seq_ids:
        n = int(rng.integers(2, 60))
        computed = n - int(rng.integers(1, 3))  # one token to decode, or two known (the step ahead's)
        blocks = [int(b) for b in rng.permutation(64)[: -(-n // BS)]]
        batch.add(seq_id, rng.integers(0, 1000, n).tolist(), 1, blocks, computed, SamplingParams())
    batch.num_computed[batch.row_of[seq_ids[1]]] = batch.num_computed[batch.row_of[seq_ids[0]]]  # a tie
    fast = batch.prepare(seq_ids, [1] * len(seq_ids))
    rows = np.array([batch.row_of[s] for s in seq_ids], dtype=np.int64)
    slow = batch._prepare_tokens(seq_ids, rows, [1] * len(seq_ids))
    assert fast.seq_ids == slow.seq_ids and fast.num_decodes == slow.num_decodes == len(seq_ids)
    for name in ("rows", "num_scheduled", "num_computed", "input_ids", "positions", "slot_mapping", "query_start_loc"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), name
    assert fast.sample_mask.tolist() == slow.sample_mask.tolist() and not fast.sample_mask.all()


@pytest.mark.parametrize("known", [1, 2])
def test_a_one_row_decode_step_gets_the_inputs_of_the_per_token_expansion(known: int) -> None:
    """Batch 1 takes `prepare`'s one-row shortcut: every input (values and dtypes) the general expansion's, and a row
    whose sampled token is not yet known (`known` = 2: a step planned ahead) not sampling."""
    batch = InputBatch(max_rows=4, max_model_len=64, max_blocks_per_seq=16, block_size=BS)
    batch.add(3, [1, 2], 1, [9], 0, SamplingParams())  # another row, so seq 5's row is not row 0
    batch.add(5, list(range(100, 123)), 4, [11, 2, 7, 5, 13, 6], 23 - known, SamplingParams())
    fast = batch.prepare([5], [1])
    slow = batch._prepare_tokens([5], np.array([batch.row_of[5]], dtype=np.int64), [1])
    assert fast.seq_ids == slow.seq_ids == [5] and fast.num_decodes == slow.num_decodes == 1
    for name in fields(StepInputs):
        a, b = getattr(fast, name.name), getattr(slow, name.name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist(), name.name
    # position 23 - known sits in block index 5 (block 6) at offset (23 - known) % 4
    assert fast.slot_mapping.tolist() == [6 * BS + (23 - known) % BS]
    assert fast.input_ids.tolist() == [100 + 23 - known] and fast.sample_mask.tolist() == [known == 1]
    fast.input_ids[0] = -1  # the step's inputs are its own, not views of the batch's token table
    assert batch.token_ids[batch.row_of[5], 23 - known] == 100 + 23 - known


def test_rows_are_reused_and_membership_is_checked() -> None:
    batch = make_batch(rows=2)
    batch.add(1, [1], 1, [0], 0, SamplingParams())
    with pytest.raises(ValueError, match="already"):
        batch.add(1, [1], 1, [0], 0, SamplingParams())
    batch.add(2, [1], 1, [1], 0, SamplingParams())
    with pytest.raises(RuntimeError, match="full"):
        batch.add(3, [1], 1, [2], 0, SamplingParams())
    batch.remove(1)
    batch.remove(1)  # unknown ids are ignored
    batch.add(3, [1], 1, [2], 0, SamplingParams())
    assert len(batch) == 2 and batch.row_of[3] not in (batch.row_of[2],)
