"""The chart and the compose file repeat the services' default ports for their own users: they must agree with the
one place the services read them (services/common/ports.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.common import ports

ROOT = Path(__file__).resolve().parents[2]


def test_chart_values_use_the_services_default_ports() -> None:
    values = yaml.safe_load((ROOT / "helm/pagoda/values.yaml").read_text())
    assert values["frontend"]["grpcPort"] == ports.FRONTEND_GRPC_PORT
    assert values["frontend"]["httpPort"] == ports.FRONTEND_HTTP_PORT
    assert values["scheduler"]["port"] == ports.SCHEDULER_PORT
    assert values["scheduler"]["metricsPort"] == ports.SCHEDULER_METRICS_PORT
    assert values["worker"]["port"] == ports.WORKER_PORT
    assert values["worker"]["metricsPort"] == ports.WORKER_METRICS_PORT


def test_compose_uses_the_services_default_ports() -> None:
    services = yaml.safe_load((ROOT / "deploy/compose.yaml").read_text())["services"]
    command = {name: " ".join(str(a) for a in spec.get("command", [])) for name, spec in services.items()}
    assert f"--worker-port={ports.WORKER_PORT}" in command["worker"]
    assert f"--metrics-port={ports.WORKER_METRICS_PORT}" in command["worker"]
    assert f"--scheduler-port={ports.SCHEDULER_PORT}" in command["scheduler"]
    assert f"--metrics-port={ports.SCHEDULER_METRICS_PORT}" in command["scheduler"]
    assert f"--grpc-port={ports.FRONTEND_GRPC_PORT}" in command["frontend"]
    assert f"--http-port={ports.FRONTEND_HTTP_PORT}" in command["frontend"]
