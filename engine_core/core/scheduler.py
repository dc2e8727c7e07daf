"""Iteration-level continuous batching with chunked prefill, prefix caching, forking and recompute preemption.

There are no prefill/decode phases (as in vLLM V1): every sequence has `num_computed_tokens` and a target, and each
step closes the gap for as many sequences as the token budget and `max_num_seqs` allow. Running sequences go first;
waiting ones are admitted only if nobody was preempted this step.

`schedule_ahead` plans step N+1 while step N runs (async scheduling, for remote workers): a token that step N samples
is counted in `Sequence.num_pending`, and step N+1 decodes it without knowing it (the worker holds its value).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from engine_core.config import EngineConfig
from engine_core.core.beam_group import BeamGroup, BeamTotals
from engine_core.core.grammar_gate import GrammarGate
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.request import FinishReason, LifecycleEvent, LifecycleKind, Request, Sequence, SequenceStatus
from engine_core.core.request_limits import RequestLimits
from engine_core.core.schedule_ahead import plan_ahead
from engine_core.core.step_results import SequenceUpdate, apply_results
from engine_core.plan import CachedSequenceData, ModelRunnerOutput, NewSequenceData, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.spec_decode.drafter import Drafter


class Scheduler:
    def __init__(self, config: EngineConfig, max_model_len: int, num_blocks: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.limits = RequestLimits(max_model_len, num_blocks, config.block_size, config.max_num_seqs)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._on_worker: set[int] = set()  # sequences the worker holds state for
        self._to_drop: list[int] = []  # finished/preempted since the last step: the worker forgets them
        self.num_preemptions = 0
        self.beam_groups: dict[str, BeamGroup] = {}  # request_id -> its group, for beam search requests
        self.beam_totals = BeamTotals()  # of the groups that ended, for metrics
        self.finished_beams: list[BeamGroup] = []  # ended in `update`: the engine reports their hypotheses
        # structured-output requests waiting for their grammar, outside `waiting`
        self.grammar_gate = GrammarGate(config.structured_outputs_compile_timeout)
        # the queues' order (priority, then arrival; or arrival alone): running sorts by it, the victim is its last
        self.order_key: Callable[[Sequence], tuple] = (
            (lambda s: s.sort_key) if config.scheduling_policy == "priority" else (lambda s: s.sort_key[1:])
        )
        spec = config.speculative_config
        self.drafter: Drafter | None = Drafter(spec) if spec is not None else None

    # ---- requests -------------------------------------------------------------------------------------------
    def check_request(self, n_prompt: int, n: int) -> None:
        """Raises ValueError if a request could never run here (see RequestLimits)."""
        self.limits.check(n_prompt, n)

    def add_request(self, request: Request, beam: BeamGroup | None = None) -> None:
        n_prompt, n = request.num_prompt_tokens, request.sampling_params.n
        self.check_request(n_prompt, n)
        if beam is not None:
            self.limits.check_beam(n_prompt, beam.beam_width, request.sampling_params.max_tokens)
            n = 1  # NOTE: the group forks its beams itself; `n` is how many hypotheses come back
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_index = next(self._arrivals)
        self.requests[request.request_id] = request
        # A one-token prompt has nothing to share: its n choices start independently.
        count = n if (n > 1 and n_prompt == 1) else 1
        seqs = []
        for index in range(count):
            seq = self._new_seq(request, index, list(request.prompt_token_ids))
            seq.pending_fork = n > 1 and count == 1
            seqs.append(seq)
            if beam is not None:
                beam.start(request, seq)
                self.beam_groups[request.request_id] = beam
        if not self.grammar_gate.hold(request, seqs):
            self.waiting += seqs

    def readmit_request(self, request: Request) -> None:
        """Takes over a request that was running on another scheduler (its workers failed): each unfinished choice
        comes back as a recompute-preempted sequence with the tokens it already has, so the stream continues where
        it was. Finished choices stay finished (renumbered: seq ids belong to the scheduler that made them).
        NOTE: the worker rebuilds what a resumed sequence needs from its tokens, as after a preemption: the seeded
        RNG restarts at the number of outputs, a grammar matcher replays them, drafts are proposed afresh."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        old, request.seqs = request.seqs, []
        request.arrival_index = next(self._arrivals)
        self.requests[request.request_id] = request
        now = time.monotonic()
        for prev in old:
            if prev.is_finished:
                seq = Sequence(next(self._seq_ids), request, prev.index, list(prev.token_ids), prev.num_prompt_tokens)
                seq.status, seq.finish_reason, seq.stop_reason = prev.status, prev.finish_reason, prev.stop_reason
                request.seqs.append(seq)
                continue
            seq = self._new_seq(request, prev.index, list(prev.token_ids))
            seq.num_cached_tokens, seq.pending_fork = prev.num_cached_tokens, prev.pending_fork
            seq.num_preemptions = prev.num_preemptions + 1
            self.num_preemptions += 1
            request.timings.events.append(LifecycleEvent(LifecycleKind.PREEMPTED, now, seq.index, seq.num_tokens))
            self.waiting.append(seq)

    def new_sequence(self, request: Request, token_ids: list[int]) -> Sequence:
        """A sequence of `request` that a beam group forks (index set by the group)."""
        return self._new_seq(request, 0, token_ids)

    def adopt_on_worker(self, seq: Sequence) -> None:
        """A sequence the worker learns of by a BeamDelta (a forked beam), not by its tokens."""
        self._on_worker.add(seq.seq_id)

    def _new_seq(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids, request.num_prompt_tokens)
        request.seqs.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, FinishReason.ABORT)
        return request

    def finish_seq(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """Ends a sequence now (stop string, abort, error, or a stop found by `update`) and frees its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.num_pending = 0  # a step in flight may still sample it: `update` drops that
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id, seq.output_token_ids, seq.request.cache_salt)
        self.kv.free(seq)
        self._forget(seq)
        request = seq.request
        if request.finished:
            request.timings.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
            if self.grammar_gate.held:
                self.grammar_gate.release(request.request_id)
            for s in request.seqs:
                self.seqs.pop(s.seq_id, None)

    def _forget(self, seq: Sequence) -> None:
        if seq.seq_id in self._on_worker:
            self._on_worker.discard(seq.seq_id)
            self._to_drop.append(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_gate.held)

    # ---- scheduling -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> tokens, in batch order
        new_blocks: dict[int, list[int]] = {}
        preemptions_before = self.num_preemptions

        i = 0
        self.running.sort(key=self.order_key)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending_fork and seq.num_computed_tokens >= seq.target_tokens:
                self._fork(seq, out, scheduled, new_blocks)
            num_new = min(seq.target_tokens - seq.num_computed_tokens, budget)
            ids = self.kv.allocate(seq, num_new) if num_new > 0 else []
            if ids is not None and num_new == 1 and self.drafter is not None:
                num_new, ids = self._add_drafts(seq, budget, ids)
            if ids is None:
                # NOTE: running is sorted, so the victim (lowest priority, then newest) is at or after index i.
                victim = max(self.running, key=self.order_key)
                budget += scheduled.pop(victim.seq_id, 0)
                new_blocks.pop(victim.seq_id, None)
                self._preempt(victim)
                continue  # retry the same index (the list shrank, or seq itself is gone)
            if num_new > 0:
                scheduled[seq.seq_id] = num_new
                new_blocks[seq.seq_id] = ids
                budget -= num_new
            i += 1

        if self.num_preemptions == preemptions_before:
            budget = self.admit(budget, scheduled, new_blocks)

        return self.build_output(out, scheduled, new_blocks)

    def _add_drafts(self, seq: Sequence, budget: int, ids: list[int]) -> tuple[int, list[int]]:
        """Speculative decoding: a decode row that gets drafts verifies them in the same step (1 + k tokens).

        NOTE: drafts only where the pool has room for them as they are: they never preempt anybody.
        """
        assert self.drafter is not None
        seq.spec_token_ids = []
        samples = not seq.pending_fork and seq.num_computed_tokens + 1 == seq.num_tokens  # this step samples it
        if seq.num_pending or not samples or not self.drafter.active(len(self.running)):
            return 1, ids
        params = seq.request.sampling_params
        # Room: the step's budget, max_model_len and max_tokens (a draft past the last token is never needed).
        room = min(budget, self.max_model_len - seq.num_tokens) - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        proposal = seq.draft_proposal if seq.proposal_at == seq.num_tokens else None
        drafts = self.drafter.propose(seq.seq_id, seq.token_ids, params, room, seq.request.cache_salt, proposal)
        if not drafts:
            return 1, ids
        # `ids` already hold the decode token's slot; `more` are the blocks the drafts add beyond it.
        more = self.kv.allocate(seq, 1 + len(drafts))
        if more is None:
            return 1, ids
        seq.spec_token_ids = drafts
        return 1 + len(drafts), ids + more

    def schedule_ahead(self) -> SchedulerOutput | None:
        """The next step's plan while one step is in flight, or None when it needs that step's results first
        (core/schedule_ahead.py)."""
        return plan_ahead(self)

    def admit(self, budget: int, scheduled: dict[int, int], new_blocks: dict[int, list[int]]) -> int:
        """Admits waiting sequences in order while the budget, `max_num_seqs` and the pool allow; the budget left."""
        self.waiting.sort(key=self.order_key)
        # NOTE: a running parent that will fork holds the slots of its n - 1 future siblings too; counting only
        # len(running) let other sequences take them, and the fork then overfilled the worker's batch.
        used = sum(s.request.sampling_params.n if s.pending_fork else 1 for s in self.running)
        if self.beam_groups:
            used += sum(g.slots_reserved(self.running) for g in self.beam_groups.values())
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            slots = seq.request.sampling_params.n if seq.pending_fork else 1
            if self.beam_groups and (group := self.beam_groups.get(seq.request.request_id)) is not None:
                slots = group.admission_slots(self.running)
            if used + slots > self.config.max_num_seqs:
                break
            prefix = self.kv.lookup_prefix(seq) if seq.num_computed_tokens == 0 else []
            computed = seq.num_computed_tokens + len(prefix) * self.block_size
            num_new = min(seq.target_tokens - computed, budget)
            ids = self.kv.allocate(seq, num_new, prefix)
            if ids is None:
                break  # NOTE: strict FCFS/priority: a later, smaller request does not jump the queue
            self.waiting.pop(0)
            self.kv.record_prefix_lookup(seq, prefix)
            used += slots
            seq.num_computed_tokens = computed
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = min(computed, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            timings = seq.request.timings
            if timings.first_scheduled is None:
                timings.first_scheduled = time.monotonic()
            elif seq.num_preemptions:
                timings.events.append(
                    LifecycleEvent(LifecycleKind.RESUMED, time.monotonic(), seq.index, seq.num_tokens)
                )
            self.running.append(seq)
            scheduled[seq.seq_id] = num_new
            new_blocks[seq.seq_id] = ids
            budget -= num_new
        return budget

    def _fork(
        self, parent: Sequence, out: SchedulerOutput, scheduled: dict[int, int], new_blocks: dict[int, list[int]]
    ) -> None:
        """Creates the n - 1 siblings of a parent whose shared prompt part is computed.

        Siblings that find no block for their copy of the partial block, even with every sequence after the parent
        preempted, start as waiting sequences and recompute the prompt (from the prefix cache where they can).
        NOTE: preempting the parent instead livelocked pools too small for the parent plus n - 1 copies: it came
        back to the same fork and was preempted again, forever.
        """
        request = parent.request
        while True:
            # Each sibling needs at most one block for its copy of the partial block.
            needs_copy = parent.num_computed_tokens % self.block_size != 0
            if not needs_copy or self.kv.num_free_blocks >= request.sampling_params.n - 1:
                break
            victim = max(self.running, key=self.order_key)
            if victim is parent:
                break
            scheduled.pop(victim.seq_id, None)  # never scheduled yet: victims sort after the parent
            new_blocks.pop(victim.seq_id, None)
            self._preempt(victim)
        parent.pending_fork = False
        at = self.running.index(parent) + 1
        for index in range(1, request.sampling_params.n):
            child = self._new_seq(request, index, list(parent.token_ids))
            child.num_cached_tokens = parent.num_cached_tokens
            if not self.kv.fork(parent, child, out.copy_blocks):
                self.waiting.append(child)
                continue
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.insert(at, child)
            at += 1

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, requeue at the front of its class."""
        self.running.remove(seq)
        self.kv.free(seq)
        self._forget(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_pending = 0
        seq.spec_token_ids = []
        seq.proposal_at = -1  # NOTE: the worker forgets the sequence, and the draft's q with it
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.request.timings.events.append(
            LifecycleEvent(LifecycleKind.PREEMPTED, time.monotonic(), seq.index, seq.num_tokens)
        )
        self.waiting.insert(0, seq)

    def build_output(
        self, out: SchedulerOutput, scheduled: dict[int, int], new_blocks: dict[int, list[int]]
    ) -> SchedulerOutput:
        """The step's plan from the tokens and blocks scheduled: new sequences in full, known ones as deltas."""
        if self.beam_groups:
            self._drain_beams(out)
        out.finished_seq_ids, self._to_drop = self._to_drop, []
        out.grammars = self.grammar_gate.drain()
        # NOTE: batch order = running order, so decodes and prefills interleave; the runner regroups them.
        stepped: set[str] = set()  # requests counted in this step (a request's n choices are one step)
        for seq in self.running:
            n = scheduled.get(seq.seq_id)
            if n is None:
                continue
            if seq.request.request_id not in stepped:
                stepped.add(seq.request.request_id)
                seq.request.timings.num_steps += 1
            if seq.seq_id in self._on_worker:
                out.cached_seqs.append(CachedSequenceData(seq.seq_id, new_blocks[seq.seq_id], seq.num_computed_tokens))
            else:
                self._on_worker.add(seq.seq_id)
                out.new_seqs.append(
                    NewSequenceData(
                        seq_id=seq.seq_id,
                        token_ids=list(seq.token_ids),
                        num_prompt_tokens=seq.num_prompt_tokens,
                        sampling_params=self._row_params(seq),
                        seed=seq.seed,
                        block_ids=self.kv.block_ids(seq.seq_id),
                        num_computed_tokens=seq.num_computed_tokens,
                        request_id=seq.request.request_id,
                        trace_context=seq.request.trace_context.get("traceparent", ""),
                        trace_state=seq.request.trace_context.get("tracestate", ""),
                    )
                )
            out.num_scheduled_tokens[seq.seq_id] = n
            if seq.spec_token_ids:
                out.scheduled_spec_decode_tokens[seq.seq_id] = seq.spec_token_ids
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_tokens + seq.num_pending:  # NOTE: >= : drafts count as computed
                seq.num_pending += 1  # this step reaches the end of its tokens, so the worker samples it
            self.kv.cache_computed_blocks(seq)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out

    def _row_params(self, seq: Sequence) -> SamplingParams:
        group = self.beam_groups.get(seq.request.request_id) if self.beam_groups else None
        return seq.request.sampling_params if group is None else group.row_params

    def _drain_beams(self, out: SchedulerOutput) -> None:
        for request_id, group in list(self.beam_groups.items()):
            deltas, copies = group.drain()
            out.beam_deltas += deltas
            out.copy_blocks += copies
            if request_id not in self.requests:  # ended (search done, aborted or failed)
                del self.beam_groups[request_id]
                self.beam_totals.add(group.counts)

    # ---- results ----------------------------------------------------------------------------------------------
    def update(self, runner_out: ModelRunnerOutput) -> list[SequenceUpdate]:
        """Appends sampled tokens, applies stop tokens and length limits, frees finished sequences
        (core/step_results.py)."""
        return apply_results(self, runner_out)
