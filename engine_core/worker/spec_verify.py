"""The worker's side of speculative decoding: verifying a step's draft tokens in its one forward.

A sequence with k drafts runs 1 + k query tokens (its last known token, then the drafts, written into the persistent
batch past its known tokens), so the forward yields the target's logits at k + 1 positions. Every position is
sampled by the target's own sampler, as if each were a decode step: position i's token t_i is what the target
samples after the drafts before it. The row accepts the drafts while d_i == t_{i-1}, and emits t_0 .. t_a (a accepted
drafts, then the target's own token: the first mismatch, or the bonus token after k accepted drafts).

NOTE: this is exact rejection sampling for drafts that are a point mass (n-gram lookup, a greedy draft model):
Leviathan et al. accept d with probability min(1, p(d) / q(d)) = p(d) and otherwise sample the residual
norm(max(0, p - q)) = p without d; sampling t ~ p and accepting iff t == d gives the same law (accept with p(d);
on a mismatch t is p conditioned on t != d). Greedy rows accept the longest prefix equal to the target's argmax, so
greedy output is the same with and without drafts; a seeded row's position i draws the noise of its output step i
(SeededRow), the draws of rejected positions are taken back, so it repeats run to run and matches the same request
decoded without drafts. Logprobs are the target's, of each emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_core.worker.input_batch import InputBatch, StepInputs


def write_drafts(batch: InputBatch, drafts: dict[int, list[int]]) -> None:
    """Puts each sequence's drafts after its known tokens, where the step's inputs read them (not yet its tokens)."""
    for seq_id, tokens in drafts.items():
        row = batch.row_of[seq_id]
        start = int(batch.num_tokens[row])
        batch.token_ids[row, start : start + len(tokens)] = tokens


@dataclass
class Verification:
    """The step's sampled rows expanded to one per verified position: rows of one sequence are consecutive."""

    logit_index: np.ndarray  # [expanded rows] token index into the step's hidden states
    row_seq_ids: list[int]  # [expanded rows]
    owner: np.ndarray  # [expanded rows] index of the sampled row it belongs to
    seq_ids: list[int]  # per sampled row
    drafts: list[list[int]]  # per sampled row, [] for plain decode/prefill rows

    @classmethod
    def plan(
        cls, inputs: StepInputs, sample_idx: np.ndarray, seq_ids: list[int], drafts: dict[int, list[int]]
    ) -> Verification:
        ends = inputs.query_start_loc[1:][sample_idx]
        row_drafts = [drafts.get(s, []) for s in seq_ids]
        counts = np.fromiter((1 + len(d) for d in row_drafts), dtype=np.int64, count=len(seq_ids))
        owner = np.repeat(np.arange(len(seq_ids)), counts)
        # Row j's positions end at ends[j] - 1: its last k + 1 query tokens.
        offsets = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        logit_index = np.repeat(ends - counts, counts) + offsets
        row_seq_ids = [seq_ids[j] for j in owner.tolist()]
        return cls(logit_index, row_seq_ids, owner, list(seq_ids), row_drafts)

    def accept(self, tokens: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Which expanded rows are emitted (accepted drafts + the target's token), and per sampled row how many
        drafts were accepted. `tokens` is the sampler's [expanded rows] output."""
        keep: list[int] = []
        accepted: list[int] = []
        start = 0
        for drafts in self.drafts:
            a = 0
            while a < len(drafts) and tokens[start + a] == drafts[a]:
                a += 1
            keep.extend(range(start, start + a + 1))
            accepted.append(a)
            start += len(drafts) + 1
        return np.asarray(keep, dtype=np.int64), accepted


def advance_verified(
    batch: InputBatch,
    inputs: StepInputs,
    sample_idx: np.ndarray,
    tokens: np.ndarray,
    accepted: list[int],
    drafts: list[list[int]],
) -> None:
    """`InputBatch.advance` for a step with verified rows: every row's scheduled tokens are computed, minus the
    rejected drafts; each sampled row gains its emitted tokens (`tokens`, in row order, FAILED_TOKEN already 0)."""
    batch.num_computed[inputs.rows] += inputs.num_scheduled.astype(np.int32)
    start = 0
    for j, row in enumerate(inputs.rows[sample_idx].tolist()):
        m = accepted[j] + 1
        n = int(batch.num_tokens[row])
        batch.token_ids[row, n : n + m] = tokens[start : start + m]
        batch.num_tokens[row] = n + m
        batch.num_computed[row] -= len(drafts[j]) - accepted[j]
        start += m
