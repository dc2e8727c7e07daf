"""Speculative decoding through `pagoda serve`'s services: the scheduler proposes n-gram drafts
(`--speculative-config`), the worker verifies them, and the streamed tokens are the offline engine's without drafts."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from engine_core import LLM, SamplingParams
from services.client import GenerationClient, text_request
from services.rpc import scheduler_pb2, scheduler_pb2_grpc
from tests.services.probes import start_cluster

pytestmark = pytest.mark.slow

PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Repeat exactly: the night train to Vienna leaves platform 4 at 21:40. The night train to Vienna",
    "The capital of France is",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def test_served_tokens_equal_the_offline_engines_without_drafts(
    offline_llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir: Path = tmp_path_factory.mktemp("spec-decode")
    cluster = start_cluster(
        log_dir,
        kv_cache_memory=0.25,
        dtype="float32",
        metrics_port=-1,
        extra_scheduler_args=["--speculative-config", json.dumps(SPEC)],
    )
    try:
        with GenerationClient(cluster.frontend_addr) as client:
            served = [client.generate(text_request(p, max_tokens=40)).choices[0] for p in PROMPTS]
            stopped = client.generate(text_request(PROMPTS[0], max_tokens=40, stop=[" 14,"])).choices[0]
        with grpc.insecure_channel(cluster.scheduler_addr) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
    finally:
        codes = cluster.stop(timeout=60)
    assert set(codes.values()) == {0}, codes
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert [c.token_ids for c in served] == [o.outputs[0].token_ids for o in expected]
    (want,) = offline_llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=40, stop=[" 14,"]), use_tqdm=False
    )
    assert stopped.text == want.outputs[0].text and want.outputs[0].finish_reason == "stop"
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens


def test_a_draft_model_streams_the_offline_engines_tokens(
    offline_llm: LLM, smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`--speculative-config` with method draft_model reaches the worker, which loads the draft (here the target
    itself, the only model shipped) and proposes; the streamed tokens are the offline engine's without drafts."""
    log_dir: Path = tmp_path_factory.mktemp("spec-decode-draft")
    flag = [
        "--speculative-config",
        json.dumps({"method": "draft_model", "model": smollm2_dir, "num_speculative_tokens": 3}),
    ]
    cluster = start_cluster(
        log_dir, kv_cache_memory=0.25, dtype="float32", metrics_port=-1, extra_scheduler_args=flag,
        extra_worker_args=flag,
    )  # fmt: skip
    try:
        with GenerationClient(cluster.frontend_addr) as client:
            served = [client.generate(text_request(p, max_tokens=24)).choices[0] for p in PROMPTS]
        with grpc.insecure_channel(cluster.scheduler_addr) as channel:
            stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(), timeout=5)
    finally:
        codes = cluster.stop(timeout=60)
    assert set(codes.values()) == {0}, codes
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [c.token_ids for c in served] == [o.outputs[0].token_ids for o in expected]
    # The target as its own draft: its argmax is the target's (up to rounding between batch shapes).
    assert stats.spec_decode_num_draft_tokens > 20
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
