"""The Prometheus metric set, read back with prometheus_client's parser (no services: fast)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import EngineStatsCollector, buckets_1_2_5
from services.frontend.metrics import RequestMetrics
from services.rpc import common_pb2, scheduler_pb2

MODEL = "SmolLM2-135M-Instruct"


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_token_buckets_are_vllms_1_2_5() -> None:
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_request_metrics_names_and_values() -> None:
    registry = CollectorRegistry()
    m = RequestMetrics(registry, MODEL, max_model_len=2048)
    ts = common_pb2.RequestTimestamps(queued_ns=1_000_000_000, scheduled_ns=1_500_000_000)
    ts.first_token_ns, ts.finished_ns = 2_000_000_000, 4_000_000_000
    m.observe_tokens(0.02)
    m.observe_end(["length", "stop"], 7, 9, 0.3, 3.5, ts)
    m.observe_end(["abort"], 3, 0, None, 0.1, common_pb2.RequestTimestamps())
    s = samples(registry)
    model = (("model_name", MODEL),)
    assert s[("pagoda:prompt_tokens_total", model)] == 10
    assert s[("pagoda:generation_tokens_total", model)] == 9
    for reason, n in (("length", 1), ("stop", 1), ("abort", 1)):
        assert s[("pagoda:request_success_total", (("finished_reason", reason), *model))] == n
    assert s[("pagoda:time_to_first_token_seconds_count", model)] == 1  # none for a request without tokens
    assert s[("pagoda:e2e_request_latency_seconds_count", model)] == 2
    assert s[("pagoda:request_queue_time_seconds_sum", model)] == 0.5
    assert s[("pagoda:request_prefill_time_seconds_sum", model)] == 0.5
    assert s[("pagoda:request_decode_time_seconds_sum", model)] == 2.0
    assert s[("pagoda:request_queue_time_seconds_count", model)] == 1  # never scheduled: not observed
    assert s[("pagoda:inter_token_latency_seconds_count", model)] == 1
    assert s[("pagoda:request_generation_tokens_bucket", (("le", "10.0"), *model))] == 2


def test_engine_stats_collector_exports_the_snapshot_or_nothing() -> None:
    registry = CollectorRegistry()
    latest: list[scheduler_pb2.StatsResponse | None] = [None]
    registry.register(EngineStatsCollector(lambda: latest[0], lambda: MODEL))
    assert samples(registry) == {}  # no snapshot: no made-up zeros
    latest[0] = scheduler_pb2.StatsResponse(
        running_requests=2, waiting_requests=3, kv_usage=0.25, prefix_cache_queries=64, prefix_cache_hits=16,
        preemptions=4, prefix_cache_evictions=5,
    )  # fmt: skip
    s = samples(registry)
    model = (("model_name", MODEL),)
    assert s[("pagoda:num_requests_running", model)] == 2
    assert s[("pagoda:num_requests_waiting", model)] == 3
    assert s[("pagoda:kv_cache_usage_perc", model)] == 0.25
    assert s[("pagoda:prefix_cache_queries_total", model)] == 64
    assert s[("pagoda:prefix_cache_hits_total", model)] == 16
    assert s[("pagoda:num_preemptions_total", model)] == 4
    assert s[("pagoda:prefix_cache_evictions_total", model)] == 5
