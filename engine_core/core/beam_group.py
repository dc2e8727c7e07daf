"""A beam search request in the scheduler: its live sequences, scored together, re-formed after every step.

A beam group is one `Request` with up to `beam_width` live sequences. The prompt is prefilled once (one sequence);
each step every live sequence's row returns its top candidates (the worker's logprobs, `num_beam_candidates` of
them), `BeamScorer` picks the survivors, and the group is re-formed in place:
- a live sequence with no surviving child is pruned: finished at once, its blocks back in the pool;
- its first surviving child continues in the sequence itself (the token the worker sampled is replaced);
- each further child forks: a new sequence sharing the parent's full blocks (ref counts up) with a copy of the
  partial last block (copy-on-write, `SchedulerOutput.copy_blocks`), sent to the worker as a `BeamDelta` rather than
  its tokens.
The group steps only when every live sequence has reported its row, so a preempted beam (recompute) holds the others
until it is back; a beam that reported waits with nothing to schedule (its row has no unknown token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine_core.core.beam_scorer import BeamScorer, Hypothesis
from engine_core.core.beam_stop import BeamStopStrings
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.request import BeamCounts, FinishReason, Request, Sequence, SequenceStatus
from engine_core.plan import BeamDelta
from engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_core.plan import LogprobsTensors


@dataclass
class BeamTotals:
    """The work of the beam searches that ended, for metrics (the live groups' counts are added when read)."""

    searches: int = 0
    forked: int = 0
    pruned: int = 0

    def add(self, counts: BeamCounts) -> None:
        self.searches += 1
        self.forked += counts.forked
        self.pruned += counts.pruned


class BeamHost(Protocol):
    """The scheduler's parts a group re-forms itself with (core/scheduler.py)."""

    kv: KVCacheManager
    running: list[Sequence]
    waiting: list[Sequence]
    max_model_len: int

    def new_sequence(self, request: Request, token_ids: list[int]) -> Sequence: ...

    def adopt_on_worker(self, seq: Sequence) -> None: ...

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None: ...


class BeamGroup:
    def __init__(
        self,
        row_params: SamplingParams,
        beam_width: int,
        num_returned: int,
        length_penalty: float,
        early_stopping: bool | str,
        stop_token_ids: set[int],
        max_new_tokens: int,
        stop_strings: BeamStopStrings | None = None,
    ) -> None:
        self.row_params = row_params  # what each beam runs with (greedy, num_beam_candidates logprobs)
        self.beam_width = beam_width
        self.num_returned = num_returned
        self.scorer = BeamScorer(
            beam_width, length_penalty, early_stopping, stop_token_ids, max_new_tokens, stop_strings
        )
        self.request: Request | None = None
        self.live: list[Sequence] = []  # in the scorer's running order
        self._rows: dict[int, list[tuple[int, float]]] = {}  # seq_id -> its reported candidates
        self._next_index = num_returned  # NOTE: beam indices start past the returned choices' (abort reports 0..n-1)
        self.deltas: list[BeamDelta] = []  # for the next plan
        self.copies: list[tuple[int, int]] = []
        self.done = False
        self.counts = BeamCounts(beam_width)
        self.peak_live = 0

    def start(self, request: Request, seq: Sequence) -> None:
        self.request = request
        request.timings.beam = self.counts
        seq.index = self._take_index()
        self.live = [seq]

    def _take_index(self) -> int:
        index, self._next_index = self._next_index, self._next_index + 1
        return index

    def record(self, seq: Sequence, logprobs: LogprobsTensors | None, row: int) -> None:
        """Keeps a live sequence's candidates from its row (column 0 is the sampled token, then the top-k)."""
        assert logprobs is not None, "a beam row always asks for its candidates"
        k = self.scorer.num_candidates
        ids = logprobs.token_ids[row, 1 : k + 1].tolist()
        lps = logprobs.logprobs[row, 1 : k + 1].tolist()
        self._rows[seq.seq_id] = list(zip(ids, lps, strict=True))

    @property
    def ready(self) -> bool:
        return not self.done and all(s.seq_id in self._rows and not s.is_finished for s in self.live)

    def advance(self, host: BeamHost) -> bool:
        """Scores the step and re-forms the group; True when the search ended (every sequence finished)."""
        assert self.request is not None
        live, request = self.live, self.request
        rows = [self._rows.pop(s.seq_id) for s in live]
        first = live[0]
        max_tokens = request.sampling_params.max_tokens
        at_limit = (max_tokens is not None and first.num_output_tokens + 1 >= max_tokens) or (
            first.num_tokens + 1 >= host.max_model_len
        )
        if request.timings.first_token is None:
            request.timings.first_token = time.monotonic()
        self.counts.steps += 1
        step = self.scorer.step(rows, [s.output_token_ids for s in live], at_limit)
        if step.done:
            self.done = True
            for seq in live:
                host.finish_seq(seq, FinishReason.LENGTH)
            return True
        children: dict[int, list[int]] = {}  # live index -> tokens of its surviving children, best first
        for c in step.survivors:
            children.setdefault(c.beam, []).append(c.token)
        for b, seq in enumerate(live):
            if b not in children:
                self.counts.pruned += 1
                host.finish_seq(seq, FinishReason.ABORT)  # NOTE: first, so the forks below find its blocks free
        placed: dict[tuple[int, int], Sequence] = {}
        for b, tokens in children.items():
            parent = live[b]
            on_worker = parent.status is SequenceStatus.RUNNING and parent.seq_id in host.kv.tables
            for token in tokens[1:]:
                placed[(b, token)] = self._fork(host, parent, token, on_worker)
            parent.token_ids.append(tokens[0])
            if on_worker:
                self.deltas.append(BeamDelta(parent.seq_id, parent.seq_id, tokens[0]))
            placed[(b, tokens[0])] = parent
        self.live = [placed[(c.beam, c.token)] for c in step.survivors]
        self.peak_live = max(self.peak_live, len(self.live))
        return False

    def _fork(self, host: BeamHost, parent: Sequence, token: int, on_worker: bool) -> Sequence:
        assert self.request is not None
        child = host.new_sequence(self.request, [*parent.token_ids, token])
        child.index = self._take_index()
        child.num_cached_tokens = parent.num_cached_tokens
        self.counts.forked += 1
        # NOTE: the fork shares the parent's computed blocks, so it runs before the parent appends its own token.
        if on_worker and host.kv.fork(parent, child, self.copies):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            host.running.append(child)
            host.adopt_on_worker(child)
            self.deltas.append(BeamDelta(child.seq_id, parent.seq_id, token, host.kv.block_ids(child.seq_id)))
        else:
            host.waiting.append(child)  # no block for its copy, or a preempted parent: recomputes
        return child

    @property
    def num_live(self) -> int:
        """Beams still searching (0 once the search ended)."""
        return 0 if self.done else sum(1 for s in self.live if not s.is_finished)

    def drain(self) -> tuple[list[BeamDelta], list[tuple[int, int]]]:
        deltas, copies = self.deltas, self.copies
        self.deltas, self.copies = [], []
        return deltas, copies

    def results(self) -> list[Hypothesis]:
        """The best `num_returned` hypotheses, best first (after the search ended)."""
        return self.scorer.hypotheses[: self.num_returned]

    def slots_reserved(self, running: list[Sequence]) -> int:
        """Batch slots the group holds beyond its running sequences (a running group can grow to beam_width)."""
        if self.done:
            return 0
        count = sum(1 for s in self.live if s in running)
        return self.beam_width - count if count else 0

    def admission_slots(self, running: list[Sequence]) -> int:
        """Slots a waiting sequence of the group takes: the whole width when none of the group runs (else they are
        held already, `slots_reserved`)."""
        return 0 if any(s in running for s in self.live) else self.beam_width
