"""The worker's Prometheus metrics (served on `--metrics-port`): step duration and batch size."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common.metrics import (
    BATCH_SIZE_BUCKETS,
    ITERATION_TOKEN_BUCKETS,
    STEP_SECONDS_BUCKETS,
    model_histogram,
)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.step_duration = model_histogram(
            registry,
            "worker_step_duration_seconds",
            "Time the worker spent on one step (deltas, inputs, forward pass, sampling).",
            STEP_SECONDS_BUCKETS,
        ).labels(model_name)
        self.batch_size = model_histogram(
            registry, "worker_batch_size", "Sequences in one step's batch.", BATCH_SIZE_BUCKETS
        ).labels(model_name)
        self.scheduled_tokens = model_histogram(
            registry, "worker_step_tokens", "Tokens computed in one step.", ITERATION_TOKEN_BUCKETS
        ).labels(model_name)

    def observe_step(self, seconds: float, batch_size: int, tokens: int) -> None:
        if batch_size:
            self.step_duration.observe(seconds)
            self.batch_size.observe(batch_size)
            self.scheduled_tokens.observe(tokens)
