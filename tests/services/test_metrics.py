"""The Prometheus metric set, read back with prometheus_client's parser (no services: fast; one /metrics server)."""

from __future__ import annotations

import http.client
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import EngineStatsCollector, buckets_1_2_5, serve_metrics, service_registry
from services.frontend.metrics import Rejection, RequestMetrics
from services.launcher import free_port
from services.rpc import common_pb2, scheduler_pb2
from services.scheduler.metrics import RecoveryMetrics, ResetReason
from tests.services.certs import make_test_pki

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
        preemptions=4, prefix_cache_evictions=5, spec_decode_num_drafts=6, spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=9, spec_decode_num_accepted_tokens_per_pos=[5, 3, 1, 0],
        beam_search_requests=2, beam_search_beams_forked=11, beam_search_beams_pruned=7, beam_search_live_beams=4,
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
    assert s[("pagoda:spec_decode_num_drafts_total", model)] == 6
    assert s[("pagoda:spec_decode_num_draft_tokens_total", model)] == 20
    assert s[("pagoda:spec_decode_num_accepted_tokens_total", model)] == 9
    per_pos = {
        p: s[("pagoda:spec_decode_num_accepted_tokens_per_pos_total", (*model, ("position", p)))] for p in "0123"
    }
    assert per_pos == {"0": 5, "1": 3, "2": 1, "3": 0}
    assert s[("pagoda:beam_search_requests_total", model)] == 2
    assert s[("pagoda:beam_search_beams_forked_total", model)] == 11
    assert s[("pagoda:beam_search_beams_pruned_total", model)] == 7
    assert s[("pagoda:beam_search_live_beams", model)] == 4


def test_every_service_registry_has_the_process_collectors() -> None:
    s = samples(service_registry())
    assert s[("process_resident_memory_bytes", ())] > 0
    assert s[("process_cpu_seconds_total", ())] > 0
    assert s[("process_open_fds", ())] >= 3
    assert any(name == "python_info" for name, _ in s)


def test_metrics_endpoint_serves_https_with_the_services_certificate(tmp_path: Path) -> None:
    """With TLS the scheduler's and workers' /metrics are HTTPS (what the chart's ServiceMonitor scrapes)."""
    tls = make_test_pki(tmp_path)
    registry = service_registry()
    RecoveryMetrics(registry).start(MODEL)
    port = free_port()
    serve_metrics("127.0.0.1", port, registry, tls)
    context = ssl.create_default_context(cafile=tls.ca_file)
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=10, context=context) as resp:
        text = resp.read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"pagoda:worker_resets", "process_resident_memory_bytes"} <= names
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()  # plain HTTP is refused


def test_admission_rejections_by_reason_start_at_zero() -> None:
    registry = CollectorRegistry()
    m = RequestMetrics(registry, MODEL, max_model_len=2048)
    m.observe_rejection(Rejection.MAX_INFLIGHT)
    m.observe_rejection(Rejection.MAX_INFLIGHT)
    m.observe_rejection(Rejection.SCHEDULER_UNAVAILABLE)
    s = samples(registry)
    got = {k[1]: v for k, v in s.items() if k[0] == "pagoda:request_rejections_total"}
    want = {
        (("code", "429"), ("model_name", MODEL), ("reason", "max_inflight")): 2,
        (("code", "503"), ("model_name", MODEL), ("reason", "draining")): 0,
        (("code", "429"), ("model_name", MODEL), ("reason", "scheduler_queue_full")): 0,
        (("code", "503"), ("model_name", MODEL), ("reason", "scheduler_unavailable")): 1,
    }
    assert got == want


def test_worker_resets_by_reason_and_missed_deadlines() -> None:
    registry = CollectorRegistry()
    m = RecoveryMetrics(registry)
    m.start(MODEL)
    s = samples(registry)
    assert {k[1] for k in s if k[0] == "pagoda:worker_resets_total"} == {
        (("model_name", MODEL), ("reason", r.value)) for r in ResetReason
    }
    assert s[("pagoda:step_deadline_misses_total", (("model_name", MODEL),))] == 0
    m.reset(MODEL, ResetReason.STEP_DEADLINE)
    m.reset(MODEL, ResetReason.HEARTBEAT)
    s = samples(registry)
    resets = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "pagoda:worker_resets_total"}
    assert resets == {"step_deadline": 1, "worker_error": 0, "heartbeat": 1, "step_error": 0}
    assert s[("pagoda:step_deadline_misses_total", (("model_name", MODEL),))] == 1


def test_failover_counters_start_at_zero_and_count() -> None:
    registry = CollectorRegistry()
    m = RecoveryMetrics(registry)
    m.start(MODEL)
    key = (("model_name", MODEL),)
    s = samples(registry)
    assert s[("pagoda:failover_resumed_requests_total", key)] == 0
    assert s[("pagoda:failover_poison_requests_total", key)] == 0
    m.failover(MODEL, resumed=3, poison=1)
    m.failover(MODEL, resumed=2, poison=0)
    s = samples(registry)
    assert s[("pagoda:failover_resumed_requests_total", key)] == 5
    assert s[("pagoda:failover_poison_requests_total", key)] == 1
