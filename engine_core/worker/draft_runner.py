"""The worker's draft-model proposer: after a step samples, the draft proposes k tokens for the rows that speculate,
and at the next step it hands the verification the distributions it drew them from.

The draft's KV is caught up lazily, per sequence: `_computed[seq]` counts the leading positions whose draft K/V is
valid for the sequence's tokens. A proposal first runs the draft over positions `_computed .. n-1` (n = the known
tokens; the whole prompt the first time, then the one or two tokens the last verification added) as prefill chunks,
one batched forward, and samples d_1 from the last position's logits; then one batched decode forward per further
draft. So the draft computes K/V for every token the target accepted (prompt included), and sequences that never
speculate (large batches, requests with logits processors) cost the draft nothing.

NOTE: a cached prefix (prefix caching, a forked choice) is recomputed by the draft rather than trusted: a new
sequence starts at `_computed = 0`, because the draft's copy of a shared block was written only if an earlier
sequence speculated over it. Its K/V is then rewritten with the same values, which readers of the block can share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import structlog
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.config import EngineConfig
from engine_core.sample.rejection_sampler import (
    PROPOSE_STREAM,
    RowDrafts,
    draw,
    row_generator,
    sampled_probs,
    verify_row,
)
from engine_core.sample.sampler import FAILED_TOKEN, compute_logprobs
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams
from engine_core.spec_decode.config import SpeculativeConfig
from engine_core.spec_decode.drafter import can_speculate
from engine_core.worker.draft_model import DraftModel
from engine_core.worker.input_batch import InputBatch
from engine_core.worker.spec_verify import Verification
from engine_core.worker.step_functions import pick_step_function
from engine_core.worker.step_sampling import StepSample

log = structlog.get_logger(__name__)


def is_random(params: SamplingParams) -> bool:
    """Sampled (not argmax) rows: their drafts are verified by rejection sampling against the draft's q."""
    return not params.greedy and params.top_k != 1  # NOTE: top_k == 1 samples as greedy (sampling_batch.py)


@dataclass
class _Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, vocab] the draft's q; None for a greedy row (a point mass)
    num_tokens: int  # the sequence's known tokens when proposed: the drafts follow position num_tokens - 1


@dataclass
class _Row:
    seq_id: int
    row: int
    n: int  # known tokens
    k: int  # drafts to propose (0: the row only catches up this step)
    start: int  # first position the draft computes
    end: int  # the draft computes positions start .. end-1 first (end == n where it proposes)
    params: SamplingParams


class DraftRunner:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, model: DraftModel, max_model_len: int) -> None:
        self.model = model
        self.k = spec.num_speculative_tokens
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_rows = min(spec.disable_by_batch_size, config.max_num_seqs)
        # NOTE: a proposal writes positions n-1 .. n+k-2; the pool holds up to n-1, so at most ceil(k / bs) + 1
        # blocks of them lie past the sequence's allocated blocks.
        self.scratch_per_row = -(-self.k // config.block_size) + 1
        self.max_catch_up = config.max_num_batched_tokens  # the draft's prefill tokens per proposal, all rows
        self._computed: dict[int, int] = {}
        self._proposals: dict[int, _Proposal] = {}
        device = model.device
        self._shared = torch.Generator(device=device)
        if config.seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(config.seed)
        self._seeded = torch.Generator(device=device)  # reseeded per draw for seeded rows

    @property
    def scratch_blocks(self) -> int:
        return self.max_rows * self.scratch_per_row

    def init_kv_cache(self, num_blocks: int, setting: str) -> None:
        self.model.init_kv_cache(num_blocks, self.scratch_blocks, setting)

    def forget(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)
        self._proposals.pop(seq_id, None)

    # ---- verification -----------------------------------------------------------------------------------------
    def resample(
        self,
        verify: Verification,
        logits: torch.Tensor,
        sampled: StepSample,
        batch: InputBatch,
        sampling: SamplingBatch,
    ) -> None:
        """Random rows whose drafts are this runner's proposal: Leviathan's test with the draft's q replaces the
        point-mass test, by writing into `sampled.tokens` what `Verification.accept` then reads (the accepted drafts,
        then the residual's token). Logprobs are recomputed (the target's) where a token changed."""
        start = 0
        changed: list[int] = []
        for seq_id, drafts in zip(verify.seq_ids, verify.drafts, strict=True):
            m = len(drafts)
            span = slice(start, start + m + 1)
            start += m + 1
            proposal = self._proposals.pop(seq_id, None)
            if not m or proposal is None or proposal.probs is None or proposal.tokens[:m] != drafts:
                continue
            if (sampled.tokens[span] == FAILED_TOKEN).any():
                continue  # NOTE: the row fails as it is
            params = batch.params[seq_id]
            row = batch.row_of[seq_id]
            p = sampled_probs(logits[span.start : span.start + m], [params] * m)
            row_drafts = RowDrafts(
                drafts, proposal.probs[:m], sampling.seed_of(seq_id), int(batch.num_tokens[row] - batch.num_prompt[row])
            )
            a, token = verify_row(p, row_drafts, self._shared, self._seeded)
            new = list(drafts[:a]) + ([token] if token is not None else [])
            for i, t in enumerate(new):
                if sampled.tokens[span.start + i] != t:
                    sampled.tokens[span.start + i] = t
                    changed.append(span.start + i)
        lp = sampled.logprobs
        if changed and lp is not None:
            index = torch.tensor(changed, device=logits.device)
            k = lp.token_ids.shape[1] - 1
            fresh = compute_logprobs(logits[index], torch.from_numpy(sampled.tokens[changed]).to(logits.device), k)
            lp.token_ids[index], lp.logprobs[index], lp.ranks[index] = fresh.token_ids, fresh.logprobs, fresh.ranks

    # ---- proposing --------------------------------------------------------------------------------------------
    def propose(self, batch: InputBatch, sampling: SamplingBatch, seq_ids: list[int]) -> dict[int, list[int]]:
        """After a step: the drafts for each sequence in `seq_ids` (those it sampled, each once) that speculates."""
        # NOTE: only sequences the draft has computed for have state to settle (a large batch's rows have none):
        # position n-1 holds the token the target sampled (a draft's only if it was accepted), so the draft's K/V
        # is valid before it, where the tokens are those the draft computed.
        for seq_id in self._computed.keys() & set(seq_ids) if self._computed else ():
            row = batch.row_of[seq_id]
            self._computed[seq_id] = min(self._computed[seq_id], int(batch.num_tokens[row]) - 1)
            self._proposals.pop(seq_id, None)
        if len(batch) > self.max_rows:
            return {}
        rows = self._rows(batch, seq_ids)
        if not rows:
            return {}
        try:
            return self._propose(batch, sampling, rows)
        except Exception:
            # NOTE: drafts are optional: a failing draft costs the step its proposals, never a request. The rows'
            # draft K/V may be half-written, so they recompute it at their next proposal.
            log.exception("the draft model's proposal failed; the step's rows decode without drafts")
            for r in rows:
                self._computed[r.seq_id] = 0
            return {}

    def _propose(self, batch: InputBatch, sampling: SamplingBatch, rows: list[_Row]) -> dict[int, list[int]]:
        tables = self._block_tables(batch, rows)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        with torch.inference_mode():
            logits = self._catch_up(batch, rows, tables)
            live = [j for j, r in enumerate(rows) if r.k]
            logits = logits[live]
            for i in range(max(r.k for r in rows)):
                self._sample(rows, live, logits, drafts, probs, sampling)
                live = [j for j in live if rows[j].k > i + 1]
                if not live:
                    break
                logits = self._decode(rows, live, tables, drafts, i)
        out: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            if not r.k:  # NOTE: a long sequence catching up over several steps (max_num_batched_tokens each)
                self._computed[r.seq_id] = r.end
                continue
            allocated = int(batch.num_blocks[r.row]) * self.block_size
            self._computed[r.seq_id] = min(r.n + r.k - 1, allocated)  # NOTE: scratch K/V does not last
            q = torch.stack(probs[j]) if probs[j] else None
            self._proposals[r.seq_id] = _Proposal(drafts[j], q, r.n)
            out[r.seq_id] = drafts[j]
        return out

    def _rows(self, batch: InputBatch, seq_ids: list[int]) -> list[_Row]:
        rows: list[_Row] = []
        budget = self.max_catch_up
        for seq_id in seq_ids:
            params = batch.params[seq_id]
            if not can_speculate(params):
                continue
            row = batch.row_of[seq_id]
            n = int(batch.num_tokens[row])
            # What max_model_len and max_tokens leave (the scheduler trims to its token budget too).
            k = min(self.k, self.max_model_len - n - 1)
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - (n - int(batch.num_prompt[row])) - 1)
            start = self._computed.get(seq_id, 0)
            if k < 1 or budget < 1:
                continue
            end = min(n, start + budget)
            budget -= end - start
            rows.append(_Row(seq_id, row, n, k if end == n else 0, start, end, params))
        return rows

    def _block_tables(self, batch: InputBatch, rows: list[_Row]) -> np.ndarray:
        """Each row's block table, its logical blocks past the allocated ones mapped to its own scratch blocks."""
        bs = self.block_size
        width = max(-(-(r.n + r.k - 1) // bs) for r in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for j, r in enumerate(rows):
            real = min(int(batch.num_blocks[r.row]), width)
            tables[j, :real] = batch.block_table[r.row, :real]
            extra = min(width - real, self.scratch_per_row)
            first = self.model.num_blocks + j * self.scratch_per_row
            tables[j, real : real + extra] = np.arange(first, first + extra, dtype=np.int32)
        return tables

    def _tensor(self, values: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), device=self.model.device)

    def _catch_up(self, batch: InputBatch, rows: list[_Row], tables: np.ndarray) -> torch.Tensor:
        """One forward over every row's positions start .. end-1 (as prefill chunks); the logits of each row's last."""
        q_lens = np.asarray([r.end - r.start for r in rows], dtype=np.int64)
        positions = np.concatenate([np.arange(r.start, r.end) for r in rows])
        owners = np.repeat(np.arange(len(rows)), q_lens)
        input_ids = np.concatenate([batch.token_ids[r.row, r.start : r.end] for r in rows])
        seq_lens = np.asarray([r.end for r in rows], dtype=np.int32)
        cu = np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32)
        empty = np.zeros((0, tables.shape[1]), dtype=np.int32)
        meta = AttentionMetadata(
            num_decodes=0,
            num_prefills=len(rows),
            slot_mapping=self._tensor(self._slots(tables, owners, positions)),
            decode_seq_lens=self._tensor(np.zeros(0, dtype=np.int32)),
            decode_block_tables=self._tensor(empty),
            max_decode_seq_len=0,
            prefill_query_start_loc=self._tensor(cu),
            prefill_seq_lens=self._tensor(seq_lens),
            prefill_block_tables=self._tensor(tables),
            max_prefill_query_len=int(q_lens.max()),
            prefill_query_lens_cpu=q_lens.tolist(),
            prefill_seq_lens_cpu=seq_lens.tolist(),
        )
        hidden = self._forward(input_ids, positions, meta)
        return self.model.model.compute_logits(hidden[self._tensor(cu[1:] - 1)])

    def _decode(
        self, rows: list[_Row], live: list[int], tables: np.ndarray, drafts: list[list[int]], i: int
    ) -> torch.Tensor:
        """One decode forward: draft i (0-based) of each live row at position n + i; logits for draft i + 1."""
        positions = np.asarray([rows[j].n + i for j in live], dtype=np.int64)
        sub = tables[live]
        meta = AttentionMetadata(
            num_decodes=len(live),
            num_prefills=0,
            slot_mapping=self._tensor(self._slots(sub, np.arange(len(live)), positions)),
            decode_seq_lens=self._tensor((positions + 1).astype(np.int32)),
            decode_block_tables=self._tensor(sub),
            max_decode_seq_len=int(positions.max()) + 1,
            prefill_query_start_loc=self._tensor(np.zeros(1, dtype=np.int32)),
            prefill_seq_lens=self._tensor(np.zeros(0, dtype=np.int32)),
            prefill_block_tables=self._tensor(np.zeros((0, sub.shape[1]), dtype=np.int32)),
            max_prefill_query_len=0,
            prefill_query_lens_cpu=[],
            prefill_seq_lens_cpu=[],
        )
        input_ids = np.asarray([drafts[j][i] for j in live], dtype=np.int64)
        return self.model.model.compute_logits(self._forward(input_ids, positions, meta))

    def _slots(self, tables: np.ndarray, owners: np.ndarray, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return tables[owners, positions // bs].astype(np.int64) * bs + positions % bs

    def _forward(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> torch.Tensor:
        self.model.backend.prepare(meta)
        ids, pos = self._tensor(input_ids.astype(np.int64)), self._tensor(positions.astype(np.int64))
        step = pick_step_function(self.model.model, self.model.decode_step, meta)
        return step(ids, pos, self.model.kv_caches, meta)

    def _sample(
        self,
        rows: list[_Row],
        live: list[int],
        logits: torch.Tensor,
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
        sampling: SamplingBatch,
    ) -> None:
        """Each live row's next draft from the draft's logits (row i of `logits` is live[i]): its argmax for a greedy
        row, else a draw from q (the row's temperature, top-k, top-p, min-p), q kept for the verification."""
        greedy = logits.argmax(dim=-1).tolist()
        for i, j in enumerate(live):
            r = rows[j]
            if not is_random(r.params):
                drafts[j].append(int(greedy[i]))
                continue
            q = sampled_probs(logits[i : i + 1], [r.params])[0]
            position = r.n + len(drafts[j])  # NOTE: a position of the sequence: unique per draft, run to run
            gen = row_generator(self._seeded, sampling.seed_of(r.seq_id), PROPOSE_STREAM, position) or self._shared
            drafts[j].append(draw(q, gen))
            probs[j].append(q)
