"""Verification steps on the native decode step (worker/verify_rows.py): a row of 1 + k query tokens runs as 1 + k
decode rows, the output is the same as without drafts (greedy token for token, logprobs), and steps with a prefill
chunk keep the general forward."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.sampling_params import SamplingParams
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.step_functions import StepFunction
from engine_core.worker.verify_rows import as_decode_rows
from tests.test_spec_decode import NGRAM, PROMPTS, accepted, assert_same, generate, make_core


class RecordingStep:
    """Delegates to the runner's real decode step; keeps each call's decode seq_lens."""

    def __init__(self, step: StepFunction) -> None:
        self.step = step
        self.seq_lens: list[list[int]] = []

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        self.seq_lens.append(meta.decode_seq_lens.tolist())
        return self.step(input_ids, positions, kv_caches, meta)


def test_verification_steps_take_the_native_decode_step(tiny_dir: Path) -> None:
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30, logprobs=2)] * len(PROMPTS)
    off = generate(make_core(tiny_dir, None), params)
    core = make_core(tiny_dir, NGRAM)
    runner = core.executor
    assert isinstance(runner.decode_step, NativeDecodeStep)
    recorder = RecordingStep(runner.decode_step)
    runner.decode_step = recorder
    assert_same(off, generate(core, params))
    assert accepted(core) > 10
    # A verification row on the decode step: consecutive rows of one sequence, seq_lens p + 1, p + 2, ...
    verified = [lens for lens in recorder.seq_lens if any(b == a + 1 for a, b in pairwise(lens))]
    assert verified, "no verification step ran on the native decode step"


def test_decode_and_verification_rows_become_decode_rows() -> None:
    batch = InputBatch(max_rows=4, max_model_len=32, max_blocks_per_seq=8, block_size=4)
    params = SamplingParams()
    batch.add(0, list(range(10)), 4, [3, 5, 7], 9, params)  # decode: 1 query token at position 9
    batch.add(1, list(range(6)), 6, [2, 4], 5, params)  # verification: its last token + 2 drafts
    batch.token_ids[1, 6:8] = [40, 41]
    inputs = batch.prepare([0, 1], [1, 3])
    rows = as_decode_rows(inputs, {1: [40, 41]}, max_rows=8)
    assert rows is not None
    assert rows.num_decodes == 4 and rows.rows.tolist() == [0, 1, 1, 1]
    np.testing.assert_array_equal(rows.num_computed + rows.num_scheduled, [10, 6, 7, 8])  # seq_len = position + 1
    np.testing.assert_array_equal(rows.slot_mapping, inputs.slot_mapping)
    # not a verification row: a 3-token row without drafts is a prefill chunk; too many rows for the decode step
    assert as_decode_rows(inputs, {1: [40]}, max_rows=8) is None
    assert as_decode_rows(inputs, {}, max_rows=8) is None
    assert as_decode_rows(inputs, {1: [40, 41]}, max_rows=3) is None
