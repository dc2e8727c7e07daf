"""The Helm chart rendered once per value profile and session, with the real helm binary (`deploy/get-helm.sh`)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagoda"
HELM = ROOT / ".tools" / "helm"
RELEASE = "pg"
NAMESPACE = "llm"
# Value profiles: each file under helm/pagoda/ci/ on top of values.yaml ("default": values.yaml alone); "a+b" layers
# b's file over a's, as `-f a -f b` does.
SINGLE_PROFILES = [
    "default",
    "gpu",
    "cpu",
    "tensor-parallel",
    "observability",
    "secured",
    "extras",
    "repository",
    "replicas",
]
# The combinations docs/deploy.md promises: TLS with observability (ServiceMonitor over HTTPS, KEDA autoscaling,
# tracing), on GPUs, with several ranks and the frontends' HPA, with the escape hatches and fetched weights.
COMBINED_PROFILES = [
    "secured+observability",
    "gpu+secured+observability",
    "gpu+tensor-parallel+secured",
    "cpu+observability+extras+repository",
    "replicas+secured+observability",
    "gpu+replicas+extras+repository",
]
# Profiles whose model replicas run as engine pods (a scheduler and its worker side by side).
REPLICATED = [p for p in SINGLE_PROFILES + COMBINED_PROFILES if "replicas" in p.split("+")]
PROFILES = SINGLE_PROFILES + COMBINED_PROFILES


def helm_path() -> Path:
    """The helm binary; outside CI a missing one skips, in CI (`CI` set) it fails."""
    if not HELM.is_file():
        message = f"{HELM} is missing: run `bash deploy/get-helm.sh` (make test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return HELM


def profile_args(profile: str) -> list[str]:
    if profile == "default":
        return []
    return [arg for part in profile.split("+") for arg in ("-f", str(CHART / "ci" / f"{part}-values.yaml"))]


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_path()), *args], capture_output=True, text=True, timeout=120)


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)


@dataclass
class Rendered:
    """The objects `helm template` rendered for one profile."""

    profile: str
    objects: list[dict[str, Any]]
    notes: str = ""
    text: str = ""  # the YAML stream as helm wrote it
    by_kind: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for obj in self.objects:
            self.by_kind.setdefault(obj["kind"], []).append(obj)

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return next(o for o in self.by_kind.get(kind, []) if o["metadata"]["name"] == name)

    def workloads(self) -> list[dict[str, Any]]:
        return [o for kind in ("Deployment", "StatefulSet") for o in self.by_kind.get(kind, [])]

    def component(self, name: str) -> dict[str, Any]:
        """The workload of a component (frontend, scheduler, worker, jaeger); with model replicas the scheduler and
        the worker are containers of the engine pod's workload."""
        labelled = [w for w in self.workloads() if w["metadata"]["labels"]["app.kubernetes.io/component"] == name]
        if not labelled and name in ("scheduler", "worker"):
            return self.component("engine")
        return labelled[0]

    def container(self, name: str) -> dict[str, Any]:
        """The Pagoda container of a component (its workload's only one, or the engine pod's of that name)."""
        containers = self.component(name)["spec"]["template"]["spec"]["containers"]
        return containers[0] if len(containers) == 1 else next(c for c in containers if c["name"] == name)


_cache: dict[str, Rendered] = {}


@pytest.fixture(scope="session")
def render() -> Any:
    """render(profile) -> Rendered, each profile rendered once per session."""

    def get(profile: str) -> Rendered:
        if profile not in _cache:
            out = helm_template(*profile_args(profile))
            assert out.returncode == 0, out.stderr
            objects = [o for o in yaml.safe_load_all(out.stdout) if o]
            # NOTE: `helm template` never renders NOTES.txt; a client-side dry-run install does (no cluster needed).
            dry = helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client", *profile_args(profile))
            assert dry.returncode == 0, dry.stderr
            _cache[profile] = Rendered(profile, objects, dry.stdout.partition("NOTES:")[2], out.stdout)
        return _cache[profile]

    return get
