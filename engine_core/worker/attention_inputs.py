"""A step's `AttentionMetadata` from its `StepInputs`: seq lens, block tables and query offsets, on the device."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.worker.input_batch import InputBatch, StepInputs

ToDevice = Callable[[str, np.ndarray], torch.Tensor]  # one named step input on the model's device


def attention_metadata(
    inputs: StepInputs, batch: InputBatch, block_size: int, to_device: ToDevice, full_width: bool
) -> AttentionMetadata:
    """`full_width`: block tables as wide as the batch's (CUDA), else as wide as the step's longest sequence needs."""
    if 0 < inputs.num_decodes == len(inputs.rows) and not full_width:
        return decode_metadata(inputs, batch, block_size, to_device)
    return general_metadata(inputs, batch, block_size, to_device, full_width)


def decode_metadata(inputs: StepInputs, batch: InputBatch, block_size: int, to_device: ToDevice) -> AttentionMetadata:
    """`attention_metadata` of a decode-only step on the host (batch 1's every step): the prefill part empty without
    computing it. NOTE: after the native step's weight stream every numpy call runs from cold caches, and the general
    path's prefill part (slices, a cumsum, a concatenate, casts, maxima of empty arrays) is half its calls; the
    fields are checked against the general path's one by one (tests/test_attention_inputs.py)."""
    seq_lens = inputs.num_computed + 1
    longest = int(seq_lens.max())
    width = -(-longest // block_size)
    return AttentionMetadata(
        num_decodes=len(inputs.rows),
        num_prefills=0,
        slot_mapping=to_device("slot_mapping", inputs.slot_mapping),
        decode_seq_lens=to_device("decode_seq_lens", seq_lens.astype(np.int32)),
        decode_block_tables=to_device("decode_block_tables", batch.block_tables(inputs.rows, width)),
        max_decode_seq_len=longest,
        prefill_query_start_loc=to_device("prefill_query_start_loc", np.zeros(1, dtype=np.int32)),
        prefill_seq_lens=to_device("prefill_seq_lens", np.zeros(0, dtype=np.int32)),
        prefill_block_tables=to_device("prefill_block_tables", batch.block_table[:0, :0]),
        max_prefill_query_len=0,
        prefill_query_lens_cpu=[],
        prefill_seq_lens_cpu=[],
    )


def general_metadata(
    inputs: StepInputs, batch: InputBatch, block_size: int, to_device: ToDevice, full_width: bool
) -> AttentionMetadata:
    """`attention_metadata` of any step."""
    nd = inputs.num_decodes
    rows = inputs.rows
    seq_lens = inputs.num_computed + inputs.num_scheduled
    bs = block_size

    def tables(name: str, sel: slice) -> torch.Tensor:
        if full_width:
            # NOTE: full width on CUDA: one fixed stride (no kernel respecialization, and what a graph captured).
            return to_device(name, batch.block_table[rows[sel]])
        lens = seq_lens[sel]
        width = int(-(-lens.max() // bs)) if len(lens) else 0
        return to_device(name, batch.block_tables(rows[sel], width))

    q_lens = inputs.num_scheduled[nd:]
    return AttentionMetadata(
        num_decodes=nd,
        num_prefills=len(rows) - nd,
        slot_mapping=to_device("slot_mapping", inputs.slot_mapping),
        decode_seq_lens=to_device("decode_seq_lens", seq_lens[:nd].astype(np.int32)),
        decode_block_tables=tables("decode_block_tables", slice(0, nd)),
        max_decode_seq_len=int(seq_lens[:nd].max()) if nd else 0,
        prefill_query_start_loc=to_device(
            "prefill_query_start_loc", np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
        ),
        prefill_seq_lens=to_device("prefill_seq_lens", seq_lens[nd:].astype(np.int32)),
        prefill_block_tables=tables("prefill_block_tables", slice(nd, None)),
        max_prefill_query_len=int(q_lens.max()) if len(q_lens) else 0,
        prefill_query_lens_cpu=q_lens.tolist(),
        prefill_seq_lens_cpu=seq_lens[nd:].tolist(),
    )
