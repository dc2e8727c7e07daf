"""EngineCore: the scheduler and an executor (the in-process model runner, or remote workers) in one loop.

Its methods are the whole surface the services and the offline `LLM` use: add/abort/finish a request, `step`,
`check_request` (thread-safe: it reads only frozen limits), `has_request`, `stats`. Nobody outside reaches into
`core.scheduler` or the KV cache.

With a `PipelinedExecutor` and `async_scheduling`, `step` submits step N+1 before it waits for step N, so the hops to
the workers and the scheduler's own work overlap the model (vLLM's async scheduling), as long as steps are short
(`PIPELINE_MAX_STEP_S`); `step` still returns the outputs of one step at a time, in order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from engine_core.beam_search import Decode, group_for
from engine_core.config import EngineConfig
from engine_core.core.beam_group import BeamGroup
from engine_core.core.request import FinishReason, Request
from engine_core.core.request_limits import RequestLimits
from engine_core.core.scheduler import Scheduler
from engine_core.core.seq_output import SeqOutput, beam_outputs, ending_outputs, tensor_rows
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.spec_decode.stats import SpecDecodeStats
from engine_core.stats import EngineStats

log = structlog.get_logger(__name__)

# NOTE: planning step N+1 while step N runs saves one hop to the workers per step (~1-2 ms over loopback gRPC), but a
# request that arrives during step N misses N+1 (planned when N was sent) and waits for it too. Behind a short step
# both are small and the hop is a large part of the step (batch 1 here: ~2 of ~10 ms); behind a long one (a 32-row
# decode step on 2 CPU cores is ~110 ms, a 2,048-token prefill ~2.5 s) the hop is under 2 % while the wait is a whole
# step: requests arriving while 32 streams decoded had a TTFT p50 of 432-466 ms with every step planned ahead, 313-384
# with none, 312-371 with this bound (docs/benchmarks.md, "Serving TTFT"). So a step is planned ahead only after a step
# shorter than this.
PIPELINE_MAX_STEP_S = 0.05


class Executor(Protocol):
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


class StepHandle(Protocol):
    def result(self) -> ModelRunnerOutput:
        """Waits for the step; raises what executing it raised."""
        ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that runs submitted steps in order while the caller goes on (remote workers)."""

    def submit(self, plan: SchedulerOutput) -> StepHandle: ...


@dataclass
class _Submitted:
    plan: SchedulerOutput
    handle: StepHandle
    at: float  # clock reading when it was sent


class EngineCore:
    """Transport-free: `add_request`, `step`, `abort`, `finish_choice`. The scheduler service wraps exactly this.

    Not thread-safe, except `check_request` and `limits` (frozen at construction).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | PipelinedExecutor,
        max_model_len: int,
        num_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.executor = executor
        submit = getattr(executor, "submit", None)
        self._submit: Callable[[SchedulerOutput], StepHandle] | None = submit if config.async_scheduling else None
        self._in_flight: _Submitted | None = None  # submitted, its outputs not returned yet
        self._clock = clock
        self._last_result_at = 0.0
        # The workers' time on the last step (its hops included when not overlapped); none measured yet: infinite,
        # so the first step is timed before any is planned ahead of it.
        self._last_step_s = float("inf")
        capacity = num_blocks * config.block_size
        if capacity < max_model_len:
            # NOTE: a sequence longer than the whole cache could never be scheduled again after a preemption.
            log.warning("max_model_len capped to the KV cache's capacity", max_model_len=max_model_len, tokens=capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(config, max_model_len, num_blocks)
        self.limits: RequestLimits = self.scheduler.limits
        # Token ids -> text, where the engine has the tokenizer (`LLM`): beam search then ends beams on `stop` strings.
        self.beam_decode: Decode | None = None

    def check_request(self, n_prompt: int, n: int) -> None:
        """Raises ValueError if such a request could never run here. Safe from any thread (frozen limits only)."""
        self.limits.check(n_prompt, n)

    def add_request(self, request: Request, beam: BeamGroup | None = None) -> None:
        """Queues a request (a beam search with `beam`); raises ValueError (and keeps nothing) if it could never run
        or its id is in use. A request whose params set use_beam_search becomes one (its params the per-beam ones)."""
        if beam is None and request.sampling_params.use_beam_search:
            beam = group_for(request, self.max_model_len, self.beam_decode)
        self.scheduler.add_request(request, beam)

    def readmit(self, request: Request) -> None:
        """Takes over a request that ran on another EngineCore whose workers failed (services' failover): its
        unfinished choices resume as recompute-preempted sequences, continuing after the tokens they already
        reported; a step whose results never arrived is redone. A beam search restarts from its prompt.
        NOTE: a beam search streams nothing until it ends, so a restart loses no reported token and (deterministic)
        returns what the lost run would have; rebuilding a group's live beams, scores and shared blocks would not be
        simpler. Raises ValueError like `add_request`."""
        if request.sampling_params.use_beam_search:
            request.seqs = []
            self.add_request(request)
            return
        self.scheduler.check_request(request.num_prompt_tokens, request.sampling_params.n)
        self.scheduler.readmit_request(request)

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still in the engine (unfinished)."""
        return request_id in self.scheduler.requests

    def abort(self, request_id: str) -> list[SeqOutput]:
        """Ends every unfinished choice of a request; returns their ABORT outputs (empty if it is unknown)."""
        request = self.scheduler.abort_request(request_id)
        return [] if request is None else ending_outputs(request, FinishReason.ABORT, self._num_choices(request))

    def _num_choices(self, request: Request) -> int:
        group = self.scheduler.beam_groups.get(request.request_id)
        return request.sampling_params.n if group is None else group.num_returned

    def finish_choice(
        self, request_id: str, index: int, reason: FinishReason, stop_reason: str | None
    ) -> list[SeqOutput]:
        """Ends one choice early (the frontend matched a stop string); returns its output (empty if unknown)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return []
        for seq in request.seqs:
            if seq.index == index and not seq.is_finished:
                self.scheduler.finish_seq(seq, reason, stop_reason)
                t = request.timings
                out = SeqOutput(request_id, index, [], finish_reason=reason, stop_reason=stop_reason)
                out.num_draft_tokens, out.num_accepted_tokens = t.num_draft_tokens, t.num_accepted_tokens
                return [out]
        return []

    def stats(self) -> EngineStats:
        sched = self.scheduler
        pool = sched.kv.pool
        # NOTE: one pass over the running batch (at most max_num_seqs) per snapshot: requests, not sequences.
        running_requests = len({s.request.request_id for s in sched.running})
        spec = sched.drafter.stats if sched.drafter is not None else SpecDecodeStats()
        groups, totals = sched.beam_groups.values(), sched.beam_totals
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting) + sched.grammar_gate.num_seqs,
            num_requests=len(sched.requests),
            free_blocks=pool.num_free,
            total_blocks=pool.num_blocks,
            kv_usage=pool.usage,
            prefix_cache_queries=sched.kv.stats.queries,
            prefix_cache_hits=sched.kv.stats.hits,
            preemptions=sched.num_preemptions,
            prefix_cache_evictions=pool.num_evictions,
            running_requests=running_requests,
            waiting_requests=len(sched.requests) - running_requests,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
            beam_search_requests=totals.searches + len(groups),
            beam_search_beams_forked=totals.forked + sum(g.counts.forked for g in groups),
            beam_search_beams_pruned=totals.pruned + sum(g.counts.pruned for g in groups),
            beam_search_live_beams=sum(g.num_live for g in groups),
        )

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def step(self) -> list[SeqOutput]:
        """Runs one step and returns its outputs. Pipelined: the step in flight is the one returned, and the next
        one is submitted before waiting for it, when it can be planned without its results."""
        submit = self._submit
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            plan = self.scheduler.schedule()
            if (
                plan.is_empty
                and not plan.finished_seq_ids
                and not plan.copy_blocks
                and not plan.beam_deltas
                and not self.scheduler.grammar_gate.held  # NOTE: an empty step still brings the compiles' results
            ):
                return []
            if submit is None:
                return self.process(plan, self.executor.execute(plan))
            in_flight = _Submitted(plan, submit(plan), self._clock())
        assert submit is not None, "only a pipelined core has a step in flight"
        try:
            ahead = self.scheduler.schedule_ahead() if self._last_step_s < PIPELINE_MAX_STEP_S else None
            if ahead is not None:
                self._in_flight = _Submitted(ahead, submit(ahead), self._clock())
            result = in_flight.handle.result()
        except BaseException:
            self._drain()
            raise
        # NOTE: a step sent behind another starts when that one's result is back (the workers run steps in order).
        now = self._clock()
        self._last_step_s = now - max(in_flight.at, self._last_result_at)
        self._last_result_at = now
        return self.process(in_flight.plan, result)

    def _drain(self) -> None:
        """After a failed step: waits out the step submitted behind it (it fails too, or runs on a cache that the
        caller is about to reset), so no reply of the old engine arrives later."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            with contextlib.suppress(Exception):
                in_flight.handle.result()

    def process(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[SeqOutput]:
        """Applies a step's results to the scheduler and turns them into per-sequence outputs."""
        seqs = self.scheduler.seqs
        outputs: dict[int, SeqOutput] = {}
        for seq_id, plp in result.prompt_logprobs.items():
            seq = seqs.get(seq_id)
            if seq is None:
                continue
            request = seq.request
            # NOTE: a recomputed prefill (preempted, re-admitted) computes positions it already reported: not resent.
            skip = max(0, request.prompt_logprobs_end - plp.start)
            rows = tensor_rows(plp.tensors, slice(skip, None), request.sampling_params.prompt_logprobs or 0)
            if not rows:
                continue
            request.prompt_logprobs_end = plp.start + skip + len(rows)
            outputs[seq_id] = SeqOutput(
                request.request_id,
                seq.index,
                [],
                prompt_logprobs=rows,
                prompt_logprobs_start=plp.start + skip,
                num_cached_tokens=max(seq.num_cached_tokens, 0),
            )
        failed: list[Request] = []
        for upd in self.scheduler.update(result):
            seq = upd.seq
            out = outputs.get(seq.seq_id) or SeqOutput(
                seq.request.request_id, seq.index, [], num_cached_tokens=max(seq.num_cached_tokens, 0)
            )
            out.new_token_ids = upd.new_token_ids
            k = seq.request.sampling_params.logprobs
            if k is not None and result.logprobs is not None and not upd.error:
                rows = list(range(upd.row, upd.row + len(upd.new_token_ids)))  # one row per token (drafts too)
                out.new_logprobs = tensor_rows(result.logprobs, rows, k)
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
            if seq.finish_reason is not None:
                timings = seq.request.timings
                out.num_draft_tokens, out.num_accepted_tokens = timings.num_draft_tokens, timings.num_accepted_tokens
            if upd.error:
                out.error = upd.error
                failed.append(seq.request)
                if self.scheduler.beam_groups and seq.request.request_id in self.scheduler.beam_groups:
                    out.index = 0  # NOTE: a beam's own index means nothing to the client: the error ends choice 0
            outputs[seq.seq_id] = out
        ended = list(outputs.values())
        if self.scheduler.finished_beams:
            for group in self.scheduler.finished_beams:
                ended += beam_outputs(group)
            self.scheduler.finished_beams = []
        for request in failed:
            # NOTE: a request fails as a whole: its other choices (never-forked ones included) end with ERROR too.
            for seq in request.seqs:
                self.scheduler.finish_seq(seq, FinishReason.ERROR)
            reported = {o.index for o in ended if o.request_id == request.request_id}
            choices = self._num_choices(request)
            ended += [o for o in ending_outputs(request, FinishReason.ERROR, choices) if o.index not in reported]
        return ended
