"""One local cluster (worker, scheduler, frontend as real processes on loopback) for the whole test session."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.client import GenerationClient
from services.launcher import LaunchConfig, LocalCluster
from services.rpc import scheduler_pb2, scheduler_pb2_grpc
from tests.services.probes import start_healthy

# NOTE: as tests/conftest.py's offline_llm, the in-process engine the services must reproduce.
KV_CACHE_GIB = 0.5


@pytest.fixture(scope="session")
def cluster(
    smollm2_dir: str, smollm2_tokenizer: object, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    # NOTE: smollm2_dir and smollm2_tokenizer first: the GGUF conversion and the tokenizer snapshot are cached before
    # three processes look for them at once (and the frontend starts as it does after a first start).
    log_dir = tmp_path_factory.mktemp("service-logs")
    config = LaunchConfig.on_loopback(
        dtype="float32",
        kv_cache_memory=KV_CACHE_GIB,
        # NOTE: one torch thread: on a 2-core machine the worker's OpenMP team otherwise fights the scheduler,
        # the frontend and this process for the cores, and spinning OpenMP threads slow every step several-fold.
        num_threads=1,
        max_num_seqs=64,
        log_dir=str(log_dir),
        metrics_port=-1,  # NOTE: the fixed defaults (8001, 8002) would clash between concurrent test runs
        extra_frontend_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )
    c = start_healthy(config)
    yield c
    codes = c.stop(timeout=60)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0}, codes


@pytest.fixture(scope="session")
def client(cluster: LocalCluster) -> Iterator[GenerationClient]:
    with GenerationClient(cluster.frontend_addr) as c:
        yield c


@pytest.fixture(scope="session")
def scheduler_stats(cluster: LocalCluster) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with grpc.insecure_channel(cluster.scheduler_addr) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def stats(stub: scheduler_pb2_grpc.SchedulerStub) -> scheduler_pb2.StatsResponse:
    return stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)
