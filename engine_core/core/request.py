"""Requests and the sequences the scheduler runs.

A `Request` is what a user asked for (one prompt, `n` choices). Each choice is a `Sequence`, the unit the
scheduler batches, allocates blocks for and may preempt. With `n > 1` the first sequence prefills the prompt
alone; the others fork from it and share its blocks (see `Scheduler._fork`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """The finish_reason string vLLM and OpenAI clients expect."""
        return {"stop_token": "stop", "stop_string": "stop"}.get(self.value, self.value)


class LifecycleKind(enum.Enum):
    PREEMPTED = "preempted"  # a sequence lost its blocks and went back to the queue (recompute preemption)
    RESUMED = "resumed"  # a preempted sequence was scheduled again


@dataclass(frozen=True)
class LifecycleEvent:
    """Something that happened to one choice of a request, at `time` (time.monotonic() of the engine)."""

    kind: LifecycleKind
    time: float
    index: int  # choice index
    num_tokens: int  # the sequence's tokens (prompt + output) at that moment


@dataclass
class BeamCounts:
    """A beam search's work (core/beam_group.py), for its request span."""

    width: int
    steps: int = 0  # scoring steps
    forked: int = 0  # beams forked from a parent (shared blocks, a copied partial one)
    pruned: int = 0  # beams ended because none of their continuations survived


@dataclass
class RequestTimings:
    """The engine's own record of a request's life (time.monotonic()); services turn it into spans and metrics."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_steps: int = 0  # steps that computed tokens for any of its choices
    # Speculative decoding, over its choices: drafts verified, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    events: list[LifecycleEvent] = field(default_factory=list)
    beam: BeamCounts | None = None  # a beam search's counts


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower value = served first (vLLM's convention)
    cache_salt: str | None = None
    prompt: str | None = None
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent/tracestate
    timings: RequestTimings = field(default_factory=RequestTimings)
    seqs: list[Sequence] = field(default_factory=list)
    arrival_index: int = 0  # tie-break for equal priorities and arrival times (FCFS)
    # Prompt positions [1, end) whose logprobs were reported: a recomputed prefill (preemption, re-admission) sends
    # only those after it.
    prompt_logprobs_end: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        # NOTE: no `len(seqs) == n` test: siblings only come from an unfinished parent's fork, so a parent that
        # ends before forking (abort, error) ends the request; the old test kept such requests tracked forever.
        return bool(self.seqs) and all(s.is_finished for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # choice index within the request
    token_ids: list[int]
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission (-1: not yet)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # An unforked parent of an n > 1 request stops its prefill one token short, then forks (Scheduler._fork).
    pending_fork: bool = False
    # Tokens that steps in flight will sample (not known yet): 1 while its step runs, 2 with a step scheduled ahead.
    num_pending: int = 0
    # Draft tokens the step in flight verifies (speculative decoding): the scheduler counted them as computed, and
    # `Scheduler.update` takes back those the worker rejected.
    spec_token_ids: list[int] = field(default_factory=list)
    # The worker's draft-model proposal for the position after token `proposal_at - 1` (valid while num_tokens is
    # still `proposal_at`): what `Drafter.propose` schedules for the draft_model method.
    draft_proposal: list[int] = field(default_factory=list)
    proposal_at: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def target_tokens(self) -> int:
        """How many tokens this sequence wants computed before it can sample (or fork); a token that a step in
        flight samples counts, so a step scheduled ahead decodes it (the worker holds its value)."""
        return self.num_prompt_tokens - 1 if self.pending_fork else self.num_tokens + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def seed(self) -> int | None:
        seed = self.request.sampling_params.seed
        # NOTE: choice i of a seeded request uses seed + i (as vLLM does), so the n choices differ but repeat.
        return None if seed is None else seed + self.index

    @property
    def sort_key(self) -> tuple[int, float, int, int]:
        """Scheduling order: priority, then arrival (FCFS); the largest key is the preemption victim."""
        r = self.request
        return (r.priority, r.timings.arrival, r.arrival_index, self.index)
