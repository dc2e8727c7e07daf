"""The offline `LLM`'s executor under tensor parallelism: every step's plan goes to ranks 1.. over their pipes, then
rank 0 (this process) executes it; the collectives inside the step keep the ranks in lockstep, and only rank 0's
output (its sampled tokens) is returned."""

from __future__ import annotations

import uuid

from engine_core.distributed.parallel_state import form_group, leave_group
from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.worker.model_runner import ModelRunner
from engine_core.worker.rank_processes import RankProcesses, free_loopback_addr


class TensorParallelExecutor:
    def __init__(self, runner: ModelRunner, ranks: RankProcesses) -> None:
        self.runner = runner
        self.ranks = ranks

    def init_cache(self, num_blocks: int) -> None:
        """Forms the group (again: a re-init tears the old one down first) and gives every rank a fresh cache."""
        addr, epoch = free_loopback_addr(), uuid.uuid4().hex
        self.ranks.init_cache(num_blocks, addr, epoch)
        try:
            form_group(self.runner.tp, addr, self.runner.device, epoch)
        except Exception as e:
            raise self.ranks.failure(e) from e
        self.runner.reset()
        self.runner.init_kv_cache(num_blocks)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.ranks.send_step(plan)
        try:
            return self.runner.execute(plan)
        except Exception as e:
            raise self.ranks.failure(e) from e

    def close(self) -> None:
        self.ranks.stop()
        leave_group()
