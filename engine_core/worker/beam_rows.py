"""The worker's side of beam search: re-parenting rows of the persistent batch from the plan's `BeamDelta`s.

A surviving beam keeps its row and only its last token (the one the worker sampled, now the beam's choice) is
replaced; a forked beam gets a new row that copies its parent's tokens in numpy, with the block table the scheduler
gave it. No row is rebuilt and no token list travels.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_core.plan import BeamDelta
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.worker.input_batch import InputBatch


def apply_beam_deltas(
    batch: InputBatch,
    sampling: SamplingBatch,
    deltas: list[BeamDelta],
    finished: list[int],
    forget: Callable[[int], None],
) -> None:
    """Applies `deltas`, forgetting the plan's `finished` sequences around them: the pruned ones first (a group's
    forks take their rows, so it never holds more than beam_width), a parent that leaves in the same plan (preempted)
    after its children copied its row."""
    parents = {d.parent_seq_id for d in deltas}
    for seq_id in finished:
        if seq_id not in parents:
            forget(seq_id)
    for delta in deltas:
        parent = batch.row_of[delta.parent_seq_id]
        n = int(batch.num_tokens[parent])
        if delta.seq_id == delta.parent_seq_id:
            batch.token_ids[parent, n - 1] = delta.token
            continue
        params = batch.params[delta.parent_seq_id]
        num_prompt = int(batch.num_prompt[parent])
        batch.add(delta.seq_id, [], num_prompt, delta.block_ids, int(batch.num_computed[parent]), params)
        row = batch.row_of[delta.seq_id]
        batch.token_ids[row, :n] = batch.token_ids[parent, :n]
        batch.token_ids[row, n - 1] = delta.token
        batch.num_tokens[row] = n
        # NOTE: beam rows are greedy with no logits processors, so their per-row sampling state is the params alone.
        tokens = batch.token_ids[row, :n]
        sampling.add(delta.seq_id, params, None, tokens[:num_prompt], tokens[num_prompt:])
    for seq_id in parents.intersection(finished):
        forget(seq_id)
