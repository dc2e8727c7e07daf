"""Small probes the reliability tests share: bounded waits on the scheduler's Stats, process memory, a cluster."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.client import GenerationClient
from services.launcher import LaunchConfig, LocalCluster, free_port
from services.rpc import generation_pb2, scheduler_pb2, scheduler_pb2_grpc


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Polls `predicate` until true; AssertionError naming `what` after `timeout` seconds (a bound, not a timing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def scheduler_stats(addr: str) -> scheduler_pb2.StatsResponse | None:
    with grpc.insecure_channel(addr) as channel:
        try:
            return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
        except grpc.RpcError:
            return None


def all_blocks_free(addr: str) -> bool:
    """No request left in the scheduler and every KV block free (cached blocks count: they are evictable)."""
    s = scheduler_stats(addr)
    return s is not None and s.num_requests == 0 and s.free_blocks == s.total_blocks > 0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_cluster(log_dir: Path, **overrides: object) -> LocalCluster:
    """A cluster on loopback with free ports; prints the logs when it does not come up."""
    config = LaunchConfig.on_loopback(
        num_threads=1,
        log_dir=str(log_dir),
    )
    for name, value in overrides.items():
        setattr(config, name, value)
    return start_healthy(config)


def start_healthy(config: LaunchConfig) -> LocalCluster:
    """Starts `config`'s cluster and waits until it is healthy; stops it and prints its logs if it does not come up."""
    cluster = LocalCluster(config)
    cluster.start()
    try:
        cluster.wait_healthy(timeout=300)
    except Exception:
        cluster.stop(timeout=5)
        if config.log_dir is not None:
            print_logs(Path(config.log_dir))
        raise
    return cluster


def print_logs(log_dir: Path, tail: int = 4000) -> None:
    for log in sorted(log_dir.glob("*.log")):
        print(f"---- {log.name}\n{log.read_text(errors='replace')[-tail:]}")


def assert_invalid_argument(client: GenerationClient, request: generation_pb2.GenerateRequest, field: str) -> None:
    """The stream is refused with INVALID_ARGUMENT and the message names `field`."""
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert field in info.value.details(), info.value.details()


def free_port_pair() -> int:
    """A port p with p + 1 free too (a LocalCluster's metrics_port: the scheduler's and worker 0's /metrics)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} of one /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out
