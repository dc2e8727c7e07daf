"""The scheduler's own Prometheus metrics: tokens per step, worker resets and missed step deadlines. Its engine
gauges and counters are the shared `EngineStatsCollector` over its Stats (services/scheduler/server.py)."""

from __future__ import annotations

from enum import Enum

from prometheus_client import CollectorRegistry, Counter

from services.common.metrics import ITERATION_TOKEN_BUCKETS, MODEL_LABEL, PREFIX, model_histogram


class StepMetrics:
    """Recorded by the executor for each step (one histogram observation)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.iteration_tokens = model_histogram(
            registry, "iteration_tokens_total", "Tokens computed per engine step.", ITERATION_TOKEN_BUCKETS
        ).labels(model_name)

    def observe(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)


class ResetReason(Enum):
    """Why the scheduler re-formed its worker group (`EngineLoop._recover`)."""

    STEP_DEADLINE = "step_deadline"  # a step's Execute passed its deadline (a hung or overloaded worker)
    WORKER_ERROR = "worker_error"  # a step's Execute failed otherwise (a worker died or answered an error)
    HEARTBEAT = "heartbeat"  # idle: a worker did not answer, or answered on another cache epoch (restarted)
    STEP_ERROR = "step_error"  # the scheduler's own step raised (an engine or conversion bug)


class RecoveryMetrics:
    """Worker resets by reason and missed step deadlines: what an operator alerts on before users report errors."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.resets = Counter(
            PREFIX + "worker_resets",
            "Times the scheduler re-formed its worker group (all ranks reset, the cache re-initialised), by reason.",
            [MODEL_LABEL, "reason"],
            registry=registry,
        )
        self.deadline_misses = Counter(
            PREFIX + "step_deadline_misses",
            "Engine steps whose Execute passed its deadline (--step-timeout plus a part per token).",
            [MODEL_LABEL],
            registry=registry,
        )
        self.resumed = Counter(
            PREFIX + "failover_resumed_requests",
            "Requests that were running when the worker group failed and resumed on the re-formed group.",
            [MODEL_LABEL],
            registry=registry,
        )
        self.poison = Counter(
            PREFIX + "failover_poison_requests",
            "Requests failed (UNAVAILABLE) for being in flight at consecutive worker group failures.",
            [MODEL_LABEL],
            registry=registry,
        )

    def start(self, model_name: str) -> None:
        """Every series at 0 once the model is known, so rate() and alerts see a reset from the first one."""
        for reason in ResetReason:
            self.resets.labels(model_name, reason.value)
        self.deadline_misses.labels(model_name)
        self.resumed.labels(model_name)
        self.poison.labels(model_name)

    def reset(self, model_name: str, reason: ResetReason) -> None:
        self.resets.labels(model_name, reason.value).inc()
        if reason is ResetReason.STEP_DEADLINE:
            self.deadline_misses.labels(model_name).inc()

    def failover(self, model_name: str, resumed: int, poison: int) -> None:
        self.resumed.labels(model_name).inc(resumed)
        self.poison.labels(model_name).inc(poison)
