"""The real ModelRunner behind `submit`, for tests of pipelined steps (EngineCore plans ahead as with remote
workers)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine_core.plan import ModelRunnerOutput, SchedulerOutput
from engine_core.worker.model_runner import ModelRunner


class ThreadedRunner:
    """Steps run on one thread, in order, while the caller goes on."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=1)

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(plan)

    def submit(self, plan: SchedulerOutput) -> Future[ModelRunnerOutput]:
        return self.pool.submit(self.runner.execute, plan)
