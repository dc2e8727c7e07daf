"""The command lines and environment the chart renders for Pagoda's containers, parsed by the real parsers."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

from services.common.flags import env_name
from services.frontend.config import parse_frontend_args
from services.scheduler.config import parse_scheduler_args
from services.worker.config import parse_worker_args

# What `pagoda <service>` runs (services/cli.py dispatches each subcommand to that service's main, which parses).
PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "frontend": parse_frontend_args,
    "scheduler": parse_scheduler_args,
    "worker": parse_worker_args,
}
# Read by the processes directly, not through a flag.
DIRECT_ENV = {"PAGODA_CACHE"}
# What the kubelet sets for the downward-API fields the chart's profiles use.
FIELD_VALUES = {
    "metadata.name": "pod-0",
    "spec.nodeName": "node-0",
    "metadata.labels['apps.kubernetes.io/pod-index']": "0",
}


@cache
def service_flags(component: str) -> frozenset[str]:
    """Every option the service's parser defines (read from its --help)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        PARSERS[component](["--help"])
    return frozenset(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", out.getvalue()))


def pagoda_containers(rendered: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for w in rendered.workloads():
        component = w["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "engine":  # model replicas: a scheduler and its worker in one pod
            out += [(c["name"], c) for c in w["spec"]["template"]["spec"]["containers"]]
        elif component in PARSERS:
            (container,) = w["spec"]["template"]["spec"]["containers"]
            out.append((component, container))
    return out


def arg_value(container: dict[str, Any], flag: str) -> str | None:
    """The value of `--flag=value` in the container's args (the chart always renders that form)."""
    for arg in container["args"]:
        name, eq, value = arg.partition("=")
        if name == flag and eq:
            return value
    return None


def container_env(rendered: Any, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet would set it (ConfigMap references resolved)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            # NOTE: the kubelet expands $(VAR) of variables defined earlier in the list.
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            continue
        source = e["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[e["name"]] = rendered.get("ConfigMap", ref["name"])["data"][ref["key"]]
        elif "fieldRef" in source:
            env[e["name"]] = FIELD_VALUES[source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"unexpected env source {source}")
    return env


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def service_args(container: dict[str, Any], component: str) -> list[str]:
    """The container's service arguments (after `pagoda <component>`)."""
    assert container["command"] == ["pagoda"]
    assert container["args"][0] == component
    return container["args"][1:]


def parse_container(rendered: Any, component: str, container: dict[str, Any]) -> Any:
    """Parses the container's args under its environment with the service's real parser; returns its config."""
    args = service_args(container, component)
    env = container_env(rendered, container)
    flags = service_flags(component)
    for name in env:
        if name.startswith("PAGODA_") and name not in DIRECT_ENV:
            assert any(env_name(f) == name for f in flags), f"{component}: {name} is no flag's variable"
    args = _local_files(container, args)
    with environment(env):
        try:
            return PARSERS[component](args)
        except SystemExit as e:
            raise AssertionError(f"pagoda {component} rejected {args} (env {env})") from e


def _local_files(container: dict[str, Any], args: list[str]) -> list[str]:
    """Each `--*-file=PATH` must lie under one of the container's volume mounts (a Secret in the pod); for parsing
    here it is replaced by a local file of the same name (the parsers check that the files exist)."""
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
    local_dir = Path(tempfile.mkdtemp(prefix="pagoda-chart-files-"))
    out = []
    for arg in args:
        flag, sep, value = arg.partition("=")
        if sep and flag.endswith("-file"):
            assert any(value.startswith(m) for m in mounts), f"{flag}={value} is not under a volume mount {mounts}"
            local = local_dir / flag.lstrip("-")
            local.write_text("chart-test-key\n")
            arg = f"{flag}={local}"
        out.append(arg)
    return out
