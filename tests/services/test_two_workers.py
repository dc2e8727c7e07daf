"""Two workers behind one scheduler (the tensor-parallel shape of the executor): every step goes to both ranks,
only rank 0 returns samples, and the tokens are the offline engine's."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from engine_core import LLM, SamplingParams
from services.client import GenerationClient, text_request
from services.launcher import free_port
from services.rpc import worker_pb2, worker_pb2_grpc
from tests.services.probes import start_cluster

PROMPT = "The capital of France is"


def test_two_workers_run_every_step_and_give_the_offline_tokens(
    smollm2_dir: str, offline_llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir: Path = tmp_path_factory.mktemp("two-workers")
    cluster = start_cluster(
        log_dir, worker_ports=[free_port(), free_port()], kv_cache_memory=0.25, dtype="float32", metrics_port=-1
    )
    try:
        with GenerationClient(cluster.frontend_addr) as client:
            served = [client.generate(text_request(PROMPT, max_tokens=12)).choices[0].token_ids for _ in range(2)]
        steps = []
        for port in cluster.config.worker_ports:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                beat = worker_pb2_grpc.WorkerStub(channel).Heartbeat(worker_pb2.HeartbeatRequest(), timeout=5)
                steps.append(beat.next_step)
    finally:
        codes = cluster.stop(timeout=60)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0, "worker1": 0}, codes
    params = SamplingParams(temperature=0, max_tokens=12)
    (expected,) = offline_llm.generate([PROMPT], params, use_tqdm=False)
    assert served == [expected.outputs[0].token_ids] * 2
    assert steps[0] == steps[1] >= 2 * 11  # NOTE: both ranks got every step of both requests
