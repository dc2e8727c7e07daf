"""Verification steps on the decode fast path: a row of 1 + k query tokens seen as 1 + k decode rows.

A verification row's query token at position p attends to the sequence's positions 0..p, which is exactly what a
decode row with the sequence's block table and seq_len p + 1 computes. Every attention backend, and the native
decode step (kernels/cpu/decode_step.cpp), writes each layer's K/V for all of the step's tokens (slot_mapping) before
any row's attention in that layer, so the row's own drafts are in the cache when its later positions read them:
causality comes from the seq_lens alone. The step then takes the decode step function (the native whole-step call on
CPU, a CUDA-graph replay on CUDA): the weights stream once for all 1 + k tokens, instead of the general forward's
per-op dispatch and prefill attention.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_core.worker.input_batch import StepInputs


def as_decode_rows(inputs: StepInputs, drafts: dict[int, list[int]], max_rows: int) -> StepInputs | None:
    """`inputs` with one decode row per query token, for the attention metadata, when every row of the step is a
    decode row or a verification row (1 + its drafts) and the tokens fit `max_rows` decode rows (what the decode
    step's inputs are sized for); None otherwise (a prefill chunk: the general forward)."""
    nd = inputs.num_decodes
    num_rows = len(inputs.rows)
    total = len(inputs.input_ids)
    if nd == num_rows or total > max_rows:
        return None
    sched = inputs.num_scheduled
    for i in range(nd, num_rows):
        row_drafts = drafts.get(inputs.seq_ids[i])
        if row_drafts is None or int(sched[i]) != 1 + len(row_drafts):
            return None
    ones = np.ones(total, dtype=sched.dtype)
    return dataclasses.replace(
        inputs,
        seq_ids=[s for s, n in zip(inputs.seq_ids, sched.tolist(), strict=True) for _ in range(n)],
        rows=np.repeat(inputs.rows, sched),
        num_scheduled=ones,
        num_computed=inputs.positions.astype(np.int64),  # row i: seq_len = its position + 1
        num_decodes=total,
        query_start_loc=np.arange(total + 1, dtype=inputs.query_start_loc.dtype),
        sample_mask=np.repeat(inputs.sample_mask, sched),
    )
