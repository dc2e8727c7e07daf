"""Prometheus metrics shared by the services: vLLM's names with a `pagoda:` prefix, vLLM's buckets, `model_name`.

Which process exports what (each name has one owner; the frontend re-exports the scheduler's engine state):
- frontend (`/metrics` on its HTTP port): the per-request counters and histograms (`RequestMetrics`, as its
  client sees them), plus the scheduler's gauges and counters fetched from `Stats` at scrape time.
- scheduler (`--metrics-port`): the engine's gauges and counters (`EngineStatsCollector`) and
  `iteration_tokens_total`.
- worker (`--metrics-port`): step duration and batch size.
Every registry also carries prometheus-client's `process_*` (CPU seconds, resident memory, open file descriptors,
start time), `python_gc_*` and `python_info` collectors (`service_registry`). With TLS (`--tls-cert-file`), each
service serves /metrics over HTTPS with its certificate (the frontend on its HTTP port, the others here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import structlog
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.tls import TlsFiles
from services.rpc import scheduler_pb2

log = structlog.get_logger(__name__)

PREFIX = "pagoda:"
MODEL_LABEL = "model_name"

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards and alerts carry over.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Worker steps: from a fast CPU/GPU decode step to a long prefill.
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def model_histogram(
    registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...] | list[float]
) -> Histogram:
    """A `pagoda:` histogram labelled by model name (every service's histograms are made here)."""
    return Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets, registry=registry)


def buckets_1_2_5(maximum: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's token-count buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > maximum:
                return out
            out.append(float(value))
        exponent += 1


def service_registry() -> CollectorRegistry:
    """A service's registry: its own metrics plus the process, GC and platform collectors of the default registry
    (an operator's `process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`)."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


def serve_metrics(host: str, port: int, registry: CollectorRegistry, tls: TlsFiles | None = None) -> None:
    """Serves `registry` at http(s)://host:port/metrics on a daemon thread; port -1 disables. With a certificate in
    `tls` it is HTTPS (no client certificate asked: a scraper verifies the server with the CA, like the frontend's
    HTTP port)."""
    if port < 0:
        return
    cert, key = (tls.cert_file, tls.key_file) if tls is not None else (None, None)
    # NOTE: a port conflict fails the process at start, like its gRPC port would: a silent missing scrape
    # target is worse.
    start_http_server(port, addr=host, registry=registry, certfile=cert, keyfile=key)
    log.info("metrics listening", addr=f"{host}:{port}", scheme="https" if cert else "http")


class EngineStatsCollector(Collector):
    """The scheduler's engine state as Prometheus gauges and counters, read from a `StatsResponse` at scrape time.

    The scheduler reads its own snapshot; the frontend the latest one it fetched over gRPC. A None snapshot
    (scheduler not ready or unreachable) exports nothing rather than zeros that would look like an idle engine.
    """

    def __init__(self, stats: Callable[[], scheduler_pb2.StatsResponse | None], model_name: Callable[[], str]) -> None:
        self.stats = stats
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # NOTE: unchecked collector: the families depend on the snapshot being there

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        labels = [self.model_name()]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests with a choice in the running batch.", s.running_requests)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (none of their choices running).",
                    s.waiting_requests)  # fmt: skip
        yield gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of the blocks in use.", s.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (a sequence lost its KV blocks and was requeued).",
                      s.preemptions)  # fmt: skip
        yield counter("prefix_cache_evictions", "Cached KV blocks evicted from the prefix cache to hold other tokens.",
                      s.prefix_cache_evictions)  # fmt: skip
        # Speculative decoding, vLLM's names: acceptance rate = accepted / draft tokens.
        yield counter("spec_decode_num_drafts", "Verification rows (a sequence's drafts verified in one step).",
                      s.spec_decode_num_drafts)  # fmt: skip
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_decode_num_accepted_tokens)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            labels=[MODEL_LABEL, "position"],
        )
        for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([*labels, str(position)], value)
        yield per_pos
        # Beam search (vLLM has none: its LLM.beam_search runs outside its engine).
        yield counter("beam_search_requests", "Beam searches added.", s.beam_search_requests)
        yield counter("beam_search_beams_forked", "Beams forked from a parent beam (its KV blocks shared).",
                      s.beam_search_beams_forked)  # fmt: skip
        yield counter("beam_search_beams_pruned", "Beams pruned (none of their continuations survived a step).",
                      s.beam_search_beams_pruned)  # fmt: skip
        yield gauge("beam_search_live_beams", "Beams searching now, over all beam searches.", s.beam_search_live_beams)
