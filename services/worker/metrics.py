"""The worker's Prometheus metrics (served on `--metrics-port`): step duration and batch size, structured output's
grammar compiles. The step histograms carry the worker's tensor-parallel `rank`; with more than one rank, the time a
step spent in collectives too."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine_core.structured_output.backend import GrammarCompile
from services.common.metrics import (
    BATCH_SIZE_BUCKETS,
    ITERATION_TOKEN_BUCKETS,
    MODEL_LABEL,
    PREFIX,
    STEP_SECONDS_BUCKETS,
    model_histogram,
)

# A matcher from the cache takes ~0.1 ms, a new JSON schema ~1-2 ms, a large grammar up to the fuel limit.
GRAMMAR_COMPILE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _rank_histogram(registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
    return Histogram(PREFIX + name, doc, [MODEL_LABEL, "rank"], buckets=buckets, registry=registry)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, rank: int = 0, world_size: int = 1) -> None:
        r = str(rank)
        self.step_duration = _rank_histogram(
            registry,
            "worker_step_duration_seconds",
            "Time the worker spent on one step (deltas, inputs, forward pass, sampling).",
            STEP_SECONDS_BUCKETS,
        ).labels(model_name, r)
        self.batch_size = _rank_histogram(
            registry, "worker_batch_size", "Sequences in one step's batch.", BATCH_SIZE_BUCKETS
        ).labels(model_name, r)
        self.scheduled_tokens = _rank_histogram(
            registry, "worker_step_tokens", "Tokens computed in one step.", ITERATION_TOKEN_BUCKETS
        ).labels(model_name, r)
        # NOTE: only with tensor parallelism: a single rank makes no collective
        self.collective = (
            _rank_histogram(
                registry,
                "worker_step_collective_seconds",
                "Time one step spent in tensor-parallel collectives (all-reduce, logits gather, token broadcast), "
                "waiting for the slower ranks included.",
                STEP_SECONDS_BUCKETS,
            ).labels(model_name, r)
            if world_size > 1
            else None
        )

        self.grammar_compile = model_histogram(
            registry,
            "structured_output_compile_seconds",
            "Time to make one sequence's grammar matcher (compiled, or copied from the cache), by the worker.",
            GRAMMAR_COMPILE_BUCKETS,
        ).labels(model_name)
        self.grammar_matchers = Counter(
            PREFIX + "structured_output_matchers",
            "Grammar matchers made, by constraint kind and whether the compiled grammar was cached.",
            ["model_name", "kind", "cache"],
            registry=registry,
        )
        self.model_name = model_name

    def observe_grammar(self, event: GrammarCompile) -> None:
        self.grammar_compile.observe(event.seconds)
        self.grammar_matchers.labels(self.model_name, event.kind, "hit" if event.cache_hit else "miss").inc()

    def observe_step(self, seconds: float, batch_size: int, tokens: int, collective_s: float = 0.0) -> None:
        if batch_size:
            self.step_duration.observe(seconds)
            self.batch_size.observe(batch_size)
            self.scheduled_tokens.observe(tokens)
            if self.collective is not None:
                self.collective.observe(collective_s)
