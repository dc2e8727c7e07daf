"""The scheduler's own Prometheus histogram (tokens per step); its engine gauges and counters are the shared
`EngineStatsCollector` over its Stats (services/scheduler/server.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from services.common.metrics import ITERATION_TOKEN_BUCKETS, MODEL_LABEL, PREFIX


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
