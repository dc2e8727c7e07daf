"""The chart's wiring, not only its syntax: the three services run as local processes with exactly the arguments and
environment the chart renders (addresses to loopback, ports to free ones, the image's cache path to the local
cache), and a Generate streams through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.client import GenerationClient, text_request
from services.common.health import LIVENESS_SERVICE, SERVING, check
from services.launcher import LaunchConfig, LocalCluster, free_port
from services.rpc import common_pb2
from tests.conftest import CACHE_DIR
from tests.deploy.conftest import Rendered, helm_template
from tests.deploy.pagoda_args import container_env, pagoda_containers, service_args

pytestmark = pytest.mark.slow

PORT_FLAGS = {"--grpc-port", "--http-port", "--scheduler-port", "--worker-port", "--metrics-port"}
# A small KV cache and one torch thread per worker: other tests share this machine's cores and memory.
TEST_VALUES = ["--set-json", "engine.kvCacheMemory=0.5", "--set", "engine.numThreads=1"]


def _render() -> Rendered:
    out = helm_template(*TEST_VALUES)
    assert out.returncode == 0, out.stderr
    return Rendered("e2e", [o for o in yaml.safe_load_all(out.stdout) if o])


def _localize(args: list[str], ports: dict[tuple[str, str], int], addrs: dict[str, str], component: str) -> list[str]:
    """Loopback instead of 0.0.0.0 and cluster DNS names, free ports instead of the chart's."""
    out = []
    for arg in args:
        flag, _, value = arg.partition("=")
        if flag == "--host":
            value = "127.0.0.1"
        elif flag in PORT_FLAGS:
            value = str(ports[(component, flag)])
        elif flag in ("--worker-addrs", "--scheduler-addr"):
            value = ",".join(addrs[a] for a in value.split(","))
        out.append(f"{flag}={value}")
    return out


def test_a_generate_streams_through_the_services_as_the_chart_runs_them(smollm2_dir: str, tmp_path: Path) -> None:
    rendered = _render()
    containers = dict(pagoda_containers(rendered))
    ports = {
        (component, a.partition("=")[0]): free_port()
        for component, c in containers.items()
        for a in service_args(c, component)
        if a.partition("=")[0] in PORT_FLAGS
    }
    grpc_flag = {"frontend": "--grpc-port", "scheduler": "--scheduler-port", "worker": "--worker-port"}
    # The cluster DNS names the chart rendered -> this machine's loopback ports.
    (worker_dns,) = next(
        a.partition("=")[2].split(",") for a in containers["scheduler"]["args"] if a.startswith("--worker-addrs=")
    )
    scheduler_dns = next(
        a.partition("=")[2] for a in containers["frontend"]["args"] if a.startswith("--scheduler-addr=")
    )
    addrs = {
        worker_dns: f"127.0.0.1:{ports[('worker', '--worker-port')]}",
        scheduler_dns: f"127.0.0.1:{ports[('scheduler', '--scheduler-port')]}",
    }
    cluster = LocalCluster(LaunchConfig(log_dir=str(tmp_path / "logs")))
    for component in ("worker", "scheduler", "frontend"):
        container = containers[component]
        env = container_env(rendered, container)
        assert env["PAGODA_CACHE"] == "/opt/pagoda/cache"  # the image's baked cache...
        env["PAGODA_CACHE"] = CACHE_DIR  # ...is this machine's (smollm2_dir converted the model into it)
        readiness = container["readinessProbe"]["grpc"]["service"]
        args = _localize(service_args(container, component), ports, addrs, component)
        addr = f"127.0.0.1:{ports[(component, grpc_flag[component])]}"
        cluster.spawn(component, "services.cli", [component, *args], addr, readiness, env)
    try:
        cluster.wait_healthy(timeout=300)
        for service in cluster.services:
            assert check(service.addr, LIVENESS_SERVICE) == SERVING, service.name
        with GenerationClient(cluster.service("frontend").addr) as client:
            messages = list(client.stream(text_request("Count to five.", max_tokens=8, ignore_eos=True)))
        assert sum(len(d.text) for m in messages for d in m.choices) > 0
        final = messages[-1].final
        assert final.usage.completion_tokens == 8
        assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    except Exception:
        for log in sorted((tmp_path / "logs").glob("*.log")):
            print(f"---- {log.name}\n{log.read_text()[-3000:]}")
        raise
    finally:
        codes = cluster.stop(timeout=60)
    assert codes == {"frontend": 0, "scheduler": 0, "worker": 0}, codes
