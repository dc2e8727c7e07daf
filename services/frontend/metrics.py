"""The frontend's Prometheus metrics: per-request counters and histograms as its clients see them, plus the
scheduler's engine gauges and counters (fetched with `Stats` at scrape time), so one scrape of the frontend's
`/metrics` tells what vLLM's `/metrics` tells."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import Enum

import grpc
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from services.common.metrics import (
    ITL_BUCKETS,
    MODEL_LABEL,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineStatsCollector,
    buckets_1_2_5,
    model_histogram,
)
from services.rpc import common_pb2, scheduler_pb2


class Rejection(Enum):
    """Why a request was refused at admission, before it ran: (reason label, the HTTP status its client got; gRPC
    clients get RESOURCE_EXHAUSTED for 429, UNAVAILABLE for 503)."""

    MAX_INFLIGHT = ("max_inflight", "429")  # this frontend holds --max-inflight requests
    DRAINING = ("draining", "503")  # this frontend is shutting down
    SCHEDULER_FULL = ("scheduler_queue_full", "429")  # the scheduler's queue holds --max-waiting-requests
    SCHEDULER_UNAVAILABLE = ("scheduler_unavailable", "503")  # not ready, draining or unreachable


class RequestMetrics:
    """Recorded by the request pipeline: one `observe_tokens` per stream message with tokens, one `observe_end`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return model_histogram(registry, name, doc, buckets)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [MODEL_LABEL, *labels], registry=registry)

        m = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(m)
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.").labels(m)
        self.request_success = counter("request_success", "Finished requests by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens of a request.", ITL_BUCKETS).labels(m)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", REQUEST_LATENCY_BUCKETS).labels(m)
        self.queue = histogram(
            "request_queue_time_seconds", "Time in the scheduler's queue.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.prefill = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.decode = histogram(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        ).labels(m)
        self.rejections = counter(
            "request_rejections", "Requests refused at admission (429/503), by reason.", ("reason", "code")
        )
        for rejection in Rejection:  # NOTE: every series from 0, so rate() and alerts see the first one
            self.rejections.labels(m, *rejection.value)
        self.structured_output = counter(
            "structured_output_requests", "Requests with an output constraint, by kind.", ("kind",)
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", token_buckets
        ).labels(m)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", token_buckets
        ).labels(m)

    def observe_rejection(self, rejection: Rejection) -> None:
        self.rejections.labels(self.model_name, *rejection.value).inc()

    def observe_structured_output(self, kind: str) -> None:
        self.structured_output.labels(self.model_name, kind).inc()

    def observe_tokens(self, since_last_token_s: float) -> None:
        self.itl.observe(since_last_token_s)

    def observe_end(
        self,
        finish_reasons: list[str],
        prompt_tokens: int,
        generation_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
        ts: common_pb2.RequestTimestamps,
    ) -> None:
        """A finished request; `ts` holds the scheduler's timestamps (0 = never reached)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        for reason in finish_reasons:
            # NOTE: per choice, as vLLM counts per finished sequence with n > 1.
            self.request_success.labels(self.model_name, reason).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if ts.queued_ns and ts.scheduled_ns:
            self.queue.observe(max(0, ts.scheduled_ns - ts.queued_ns) / 1e9)
        if ts.scheduled_ns and ts.first_token_ns:
            self.prefill.observe(max(0, ts.first_token_ns - ts.scheduled_ns) / 1e9)
        if ts.first_token_ns and ts.finished_ns:
            self.decode.observe(max(0, ts.finished_ns - ts.first_token_ns) / 1e9)


class SchedulerStatsCache:
    """The latest `Stats` the frontend fetched (at each scrape of /metrics), read by the collector."""

    def __init__(self) -> None:
        self.latest: scheduler_pb2.StatsResponse | None = None


def add_metrics_route(
    app: FastAPI,
    registry: CollectorRegistry,
    model_name: str,
    fetch: Callable[[], Awaitable[scheduler_pb2.StatsResponse]],
) -> None:
    """`GET /metrics`: this registry plus the scheduler's engine state, fetched with `Stats` for each scrape."""
    cache = SchedulerStatsCache()
    registry.register(EngineStatsCollector(lambda: cache.latest, lambda: model_name))

    async def metrics() -> Response:
        try:
            cache.latest = await fetch()
        except grpc.aio.AioRpcError:
            cache.latest = None  # NOTE: the scheduler's families are left out, the frontend's own still served
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
