"""The scheduler's own Prometheus histogram (tokens per step); its engine gauges and counters are the shared
`EngineStatsCollector` over its Stats (services/scheduler/server.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common.metrics import ITERATION_TOKEN_BUCKETS, model_histogram


class StepMetrics:
    """Recorded by the executor for each step (one histogram observation)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.iteration_tokens = model_histogram(
            registry, "iteration_tokens_total", "Tokens computed per engine step.", ITERATION_TOKEN_BUCKETS
        ).labels(model_name)

    def observe(self, num_tokens: int) -> None:
        if num_tokens:
            self.iteration_tokens.observe(num_tokens)
