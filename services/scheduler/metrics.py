"""The scheduler's Prometheus metrics (served on `--metrics-port`): the engine's state and tokens per step."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from services.common.metrics import ITERATION_TOKEN_BUCKETS, MODEL_LABEL, PREFIX, EngineStatsCollector
from services.rpc import scheduler_pb2


class StepMetrics:
    """Recorded by the executor for each step (one histogram observation)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total",
            "Tokens computed per engine step.",
            [MODEL_LABEL],
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=registry,
        ).labels(model_name)

    def observe(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)


def scheduler_registry(
    stats: Callable[[], scheduler_pb2.StatsResponse | None], model_name: Callable[[], str]
) -> CollectorRegistry:
    """A registry with the engine's gauges and counters, read from the scheduler's own Stats at scrape time."""
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(stats, model_name))
    return registry
