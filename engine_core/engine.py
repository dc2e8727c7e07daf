"""EngineCore: the scheduler and an executor (the in-process model runner, or remote workers) in one loop."""

from __future__ import annotations

from typing import Protocol

import structlog

from engine_core.config import EngineConfig
from engine_core.core_output import SeqOutput, tensor_rows
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.request import FinishReason, Request
from engine_core.scheduler import Scheduler

log = structlog.get_logger(__name__)


class Executor(Protocol):
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Transport-free: `add_request`, `step`, `abort`. The scheduler service wraps exactly this."""

    def __init__(self, config: EngineConfig, executor: Executor, max_model_len: int, num_blocks: int) -> None:
        self.config = config
        self.executor = executor
        capacity = num_blocks * config.block_size
        if capacity < max_model_len:
            # NOTE: a sequence longer than the whole cache could never be scheduled again after a preemption.
            log.warning("max_model_len capped to the KV cache's capacity", max_model_len=max_model_len, tokens=capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(config, max_model_len, num_blocks)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id) is not None

    def finish_choice(self, request_id: str, index: int, reason: FinishReason, stop_reason: str | None) -> None:
        """Ends one choice early (the frontend matched a stop string)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if seq.index == index:
                self.scheduler.finish_seq(seq, reason, stop_reason)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[SeqOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.finished_seq_ids and not plan.copy_blocks:
            return []
        result = self.executor.execute(plan)
        return self.process(plan, result)

    def process(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[SeqOutput]:
        """Applies a step's results to the scheduler and turns them into per-sequence outputs."""
        seqs = self.scheduler.seqs
        outputs: dict[int, SeqOutput] = {}
        for seq_id, plp in result.prompt_logprobs.items():
            seq = seqs.get(seq_id)
            if seq is None:
                continue
            k = seq.request.sampling_params.prompt_logprobs or 0
            outputs[seq_id] = SeqOutput(
                seq.request.request_id,
                seq.index,
                [],
                prompt_logprobs=tensor_rows(plp.tensors, slice(None), k),
                prompt_logprobs_start=plp.start,
                num_cached_tokens=max(seq.num_cached_tokens, 0),
            )
        for upd in self.scheduler.update(result):
            seq = upd.seq
            out = outputs.get(seq.seq_id) or SeqOutput(
                seq.request.request_id, seq.index, [], num_cached_tokens=max(seq.num_cached_tokens, 0)
            )
            out.new_token_ids = upd.new_token_ids
            k = seq.request.sampling_params.logprobs
            if k is not None and result.logprobs is not None:
                out.new_logprobs = tensor_rows(result.logprobs, [upd.row], k)
            out.finish_reason, out.stop_reason = seq.finish_reason, seq.stop_reason
            outputs[seq.seq_id] = out
        return list(outputs.values())
