"""Async scheduling's plan (`Scheduler.schedule_ahead`): step N+1 planned while step N runs, or None when it needs
step N's results first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine_core.config import EngineConfig
from engine_core.core.beam_group import BeamGroup
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.request import Sequence
from engine_core.plan import SchedulerOutput
from engine_core.spec_decode.drafter import Drafter


class AheadHost(Protocol):
    """The scheduler's parts a plan ahead reads and takes (core/scheduler.py)."""

    config: EngineConfig
    max_model_len: int
    kv: KVCacheManager
    running: list[Sequence]
    beam_groups: dict[str, BeamGroup]
    drafter: Drafter | None
    order_key: Callable[[Sequence], tuple]

    def admit(self, budget: int, scheduled: dict[int, int], new_blocks: dict[int, list[int]]) -> int: ...

    def build_output(
        self, out: SchedulerOutput, scheduled: dict[int, int], new_blocks: dict[int, list[int]]
    ) -> SchedulerOutput: ...


def plan_ahead(host: AheadHost) -> SchedulerOutput | None:
    """The next step's plan while one step is in flight, or None when it needs that step's results first.

    A sequence the step in flight samples decodes that token next; one that certainly finishes with it (max_tokens,
    max_model_len) is left out, and one that stops on a sampled token computes one step in vain, whose result
    `update` drops. None (the caller waits, then calls `schedule`) when nothing would run, when a parent must fork
    (n > 1), or when the pool cannot hold every running sequence's next tokens: a preempted sequence would
    have to recompute a token nobody knows yet.
    """
    if host.beam_groups or any(s.pending_fork for s in host.running):
        return None  # NOTE: a beam group's next step depends on this step's scores
    if host.drafter is not None and (
        host.drafter.active(len(host.running)) or any(s.spec_token_ids for s in host.running)
    ):
        # NOTE: drafts are proposed from known tokens and a verification's count of new tokens is unknown until
        # it returns, so a batch small enough to speculate is scheduled step by step
        # (docs/architecture.md, "Speculative decoding").
        return None
    host.running.sort(key=host.order_key)
    budget = host.config.max_num_batched_tokens
    chosen: list[tuple[Sequence, int]] = []
    blocks = 0
    for seq in host.running:
        if budget <= 0:
            break
        num_new = min(seq.target_tokens - seq.num_computed_tokens, budget)
        if num_new <= 0 or finishes_in_flight(seq, host.max_model_len):
            continue
        chosen.append((seq, num_new))
        blocks += host.kv.blocks_needed(seq, num_new)
        budget -= num_new
    if blocks > host.kv.num_free_blocks:
        return None
    scheduled: dict[int, int] = {}
    new_blocks: dict[int, list[int]] = {}
    for seq, num_new in chosen:
        ids = host.kv.allocate(seq, num_new)
        assert ids is not None, "blocks were counted above"
        scheduled[seq.seq_id], new_blocks[seq.seq_id] = num_new, ids
    host.admit(budget, scheduled, new_blocks)
    if not scheduled:
        return None  # NOTE: before build_output, which would take the ids the worker must still be told to drop
    return host.build_output(SchedulerOutput(), scheduled, new_blocks)


def finishes_in_flight(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token a step in flight samples ends the sequence by length, whatever its value."""
    if not seq.num_pending:
        return False
    max_tokens = seq.request.sampling_params.max_tokens
    if max_tokens is not None and seq.num_output_tokens + seq.num_pending >= max_tokens:
        return True
    return seq.num_tokens + seq.num_pending >= max_model_len
