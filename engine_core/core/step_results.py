"""A step's results applied to the scheduler's sequences (`Scheduler.update`): sampled tokens appended, stop tokens
and length limits checked, drafts settled, failed rows ended alone, beam groups advanced, grammars settled."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from engine_core.core.beam_group import BeamGroup, BeamHost
from engine_core.core.grammar_gate import GrammarGate
from engine_core.core.request import FinishReason, Sequence, SequenceStatus
from engine_core.plan import ModelRunnerOutput
from engine_core.spec_decode.drafter import Drafter


@dataclass
class SequenceUpdate:
    """What one step did to one sequence: the tokens it sampled (rows `row`.. of ModelRunnerOutput, one per token)."""

    seq: Sequence
    new_token_ids: list[int]
    row: int
    error: str = ""  # the row failed alone (ModelRunnerOutput.errors): the sequence ended with FinishReason.ERROR


class ResultsHost(BeamHost, Protocol):
    """The scheduler's parts a step's results change (core/scheduler.py)."""

    seqs: dict[int, Sequence]
    beam_groups: dict[str, BeamGroup]
    finished_beams: list[BeamGroup]
    grammar_gate: GrammarGate
    drafter: Drafter | None


def apply_results(host: ResultsHost, runner_out: ModelRunnerOutput) -> list[SequenceUpdate]:
    """Appends sampled tokens, applies stop tokens and length limits, frees finished sequences."""
    updates = []
    now = time.monotonic()
    seq_ids, sampled = runner_out.seq_ids, runner_out.sampled_token_ids
    if len(seq_ids) != len(sampled):
        raise ValueError(f"{len(seq_ids)} seq_ids but {len(sampled)} sampled tokens")
    row = 0
    while row < len(seq_ids):
        seq_id, end = seq_ids[row], row + 1
        while end < len(seq_ids) and seq_ids[end] == seq_id:
            end += 1  # a verified sequence's accepted drafts and its own token
        first, row = row, end
        seq = host.seqs.get(seq_id)
        if seq is None or seq.is_finished or seq.status is not SequenceStatus.RUNNING:
            continue  # aborted or preempted while the step ran, or stopped in the step before
        seq.num_pending -= 1
        if seq.spec_token_ids:
            assert host.drafter is not None
            settle_drafts(host.drafter, seq, end - first - 1)
        error = runner_out.errors.get(seq_id)
        if error is not None:
            # NOTE: this sequence alone ends (its blocks freed, the worker told to forget it); the step's other
            # rows go on. Its request's other choices are ended by the engine (EngineCore.process).
            updates.append(SequenceUpdate(seq, [], first, error))
            host.finish_seq(seq, FinishReason.ERROR)
            continue
        if host.beam_groups and (group := host.beam_groups.get(seq.request.request_id)) is not None:
            group.record(seq, runner_out.logprobs, first)  # NOTE: its token comes from the group's step
            continue
        if seq.request.timings.first_token is None:
            seq.request.timings.first_token = now
        new_tokens: list[int] = []
        for token in sampled[first:end]:
            seq.token_ids.append(token)
            new_tokens.append(token)
            reason, stop_reason = check_stop(seq, token, host.max_model_len)
            if reason is not None:
                # NOTE: a stop inside an accepted run truncates it: the tokens after it are dropped.
                host.finish_seq(seq, reason, stop_reason)
                break
        updates.append(SequenceUpdate(seq, new_tokens, first))
        if runner_out.draft_token_ids and not seq.is_finished:
            seq.draft_proposal = runner_out.draft_token_ids.get(seq_id, [])
            seq.proposal_at = seq.num_tokens
    if host.beam_groups:
        for group in list(host.beam_groups.values()):
            if group.ready and group.advance(host):
                host.finished_beams.append(group)
    if host.grammar_gate.held:
        settle_grammars(host, runner_out.grammar_results, updates)
    return updates


def settle_grammars(host: ResultsHost, results: dict[str, str], updates: list[SequenceUpdate]) -> None:
    """Queues the requests whose grammar the worker compiled; fails, alone, those whose compile failed or
    outlasted the gate's deadline."""
    gate = host.grammar_gate.settle(results)
    host.waiting += gate.ready
    for request, error in gate.failed:
        for seq in request.seqs:
            updates.append(SequenceUpdate(seq, [], 0, error))
            host.finish_seq(seq, FinishReason.ERROR)


def settle_drafts(drafter: Drafter, seq: Sequence, num_accepted: int) -> None:
    """A verification came back: the rejected drafts' positions are no longer computed (their KV slots are
    written again by the next step), and the drafter learns how it did."""
    drafts, seq.spec_token_ids = seq.spec_token_ids, []
    num_accepted = max(0, min(num_accepted, len(drafts)))
    seq.num_computed_tokens -= len(drafts) - num_accepted
    timings = seq.request.timings
    timings.num_draft_tokens += len(drafts)
    timings.num_accepted_tokens += num_accepted
    drafter.record(seq.seq_id, len(drafts), num_accepted)


def check_stop(seq: Sequence, token: int, max_model_len: int) -> tuple[FinishReason | None, int | None]:
    params = seq.request.sampling_params
    if seq.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
        # vLLM reports stop_reason None for EOS and the token id for an explicit stop_token_id.
        return FinishReason.STOP_TOKEN, (None if token == params.eos_token_id else token)
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH, None
    if seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None
