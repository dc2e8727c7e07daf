"""`pagoda serve --tensor-parallel-size 2` through the launcher: two worker ranks (real processes, a gloo group on
loopback) stream the tokens of the single-rank offline engine, greedy and seeded; after rank 1 is killed and
restarted, the scheduler's new cache epoch re-forms the group (every InitCache does) and the tokens are the same.
Traced, each engine step has one `Execute` span per rank under it, with the rank's time in collectives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_core import LLM, SamplingParams
from services.client import GenerationClient
from services.launcher import LaunchConfig
from services.rpc import common_pb2, generation_pb2
from tests.services.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.services.probes import start_healthy
from tests.test_tensor_parallel import PROMPTS, tiny_llama

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
TRACE_ID = "5bf92f3577b34da6a3ce929d0e0e4737"


def request(ids: list[int], seed: int | None) -> generation_pb2.GenerateRequest:
    opts = common_pb2.SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=True)
    if seed is None:
        opts.temperature = 0.0
    else:
        opts.temperature, opts.seed = 1.0, seed
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=opts)


def served(client: GenerationClient) -> list[list[int]]:
    out = []
    for seed in (None, 7):
        out += [client.generate(request(p, seed)).choices[0].token_ids for p in PROMPTS]
    return out


def one_execute_per_rank(spans: list[ReceivedSpan]) -> bool:
    """Every traced step of the trace has its two ranks' `Execute` spans as children."""
    mine = [s for s in spans if s.trace_id == TRACE_ID]
    steps = [s for s in mine if s.name == "step"]
    ranks = {
        s.span_id: sorted(e.attributes["pagoda.worker.rank"] for e in mine if e.parent_span_id == s.span_id)
        for s in steps
    }
    return bool(steps) and all(r == [0, 1] for r in ranks.values())


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def test_two_ranks_stream_the_single_rank_tokens(tmp_path: Path, smollm2_dir: str, receiver: OtlpReceiver) -> None:
    model = str(tiny_llama(tmp_path / "model", smollm2_dir))
    llm = LLM(model, kv_cache_memory=0.01)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = []
    for params in (
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    ):
        expected += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    config = LaunchConfig.on_loopback(
        tensor_parallel_size=2,
        collect_detailed_traces=True,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        model=model,
        dtype="float32",
        kv_cache_memory=0.01,
        num_threads=1,
        max_num_seqs=16,
        log_dir=str(tmp_path / "logs"),
        metrics_port=-1,
    )
    cluster = start_healthy(config)
    try:
        with GenerationClient(cluster.frontend_addr) as client:
            assert served(client) == expected
            traced = request(PROMPTS[2], None)
            assert list(client.stream(traced, (("traceparent", f"00-{TRACE_ID}-00f067aa0ba902b7-01"),)))
            spans = receiver.wait_for(one_execute_per_rank)
            executes = [s for s in spans if s.trace_id == TRACE_ID and s.name == "Execute"]
            # a step that computed something made collectives (a step that only dropped sequences made none)
            assert any(s.attributes.get("pagoda.step.collective_s", 0) > 0 for s in executes)
            rank1 = cluster.service("worker1")
            rank1.process.kill()
            rank1.process.wait()
            cluster.restart("worker1")
            cluster.wait_healthy(timeout=300)
            deadline = time.monotonic() + 120
            while True:  # the scheduler notices the lost rank, waits for it and re-initialises both ranks
                try:
                    again = served(client)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert again == expected
    finally:
        codes = cluster.stop(timeout=60)
    assert codes == {"frontend": 0, "scheduler": 0, "worker0": 0, "worker1": 0}, codes
