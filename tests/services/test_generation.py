"""Streaming generation through frontend -> scheduler -> worker, checked against the offline engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine_core import LLM, SamplingParams
from services.client import GenerationClient, GenerationResult, text_request
from services.common.health import NOT_SERVING, SERVING
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2, scheduler_pb2_grpc
from tests.services.conftest import stats

pytestmark = pytest.mark.slow

TOPICS = [
    "the ocean", "a lighthouse", "bread", "volcanoes", "chess", "the moon", "bees", "trains",
    "rain", "a violin", "glaciers", "coffee", "owls", "the desert", "bridges", "tea",
    "a library", "snow", "rivers", "clocks", "mushrooms", "kites", "the harbor", "autumn",
    "cats", "mountains", "lanterns", "pottery", "whales", "a garden", "thunder", "maps",
]  # fmt: skip
PROMPTS = [f"Here is one interesting fact about {t}:" for t in TOPICS]


def test_stream_through_all_services(client: GenerationClient) -> None:
    request = text_request("The capital of France is", max_tokens=12, ignore_eos=True)
    messages = list(client.stream(request))
    assert len(messages) >= 6, "tokens must arrive as a stream, not in one message"
    assert list(messages[0].prompt_token_ids), "the first message carries the prompt's token ids"
    tokens = [t for m in messages for d in m.choices for t in d.token_ids]
    assert len(tokens) == 12
    final = messages[-1].final
    assert messages[-1].HasField("final") and not any(m.HasField("final") for m in messages[:-1])
    assert final.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == len(messages[0].prompt_token_ids)
    assert final.usage.completion_tokens == 12
    assert 0 < final.timings.ttft_s <= final.timings.e2e_s
    assert 0 <= final.timings.queue_s <= final.timings.ttft_s


def test_concurrent_greedy_streams_match_offline(client: GenerationClient, offline_llm: LLM) -> None:
    max_tokens = 16
    expected = offline_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    start = threading.Barrier(len(PROMPTS))

    def run(prompt: str) -> GenerationResult:
        start.wait()  # NOTE: all 32 in flight together, so the scheduler really batches them
        return client.generate(text_request(prompt, max_tokens=max_tokens))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, PROMPTS))
    for prompt, got, want in zip(PROMPTS, results, expected, strict=True):
        assert got.choices[0].token_ids == want.outputs[0].token_ids, prompt
        assert got.choices[0].text == want.outputs[0].text, prompt


def test_stop_strings_and_seeded_sampling_match_offline(client: GenerationClient, offline_llm: LLM) -> None:
    cases = [
        (SamplingParams(temperature=0.0, max_tokens=24, stop=["."]), {"stop": ["."]}),
        (
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=12, stop=[" the "]),
            {"temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 2, "stop": [" the "]},
        ),
        (SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), {"logprobs": 3}),
    ]
    prompt = "Tell me about the history of tea."
    stopped_by_string = 0
    for params, opts in cases:
        want = offline_llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        temperature = opts.pop("temperature", 0.0)
        request = text_request(prompt, max_tokens=params.max_tokens, temperature=temperature, chat=True, **opts)
        got = client.generate(request)
        assert [c.text for c in got.choices] == [o.text for o in want.outputs], opts
        assert [c.token_ids for c in got.choices] == [o.token_ids for o in want.outputs], opts
        for c, o in zip(got.choices, want.outputs, strict=True):
            if isinstance(o.stop_reason, str):
                assert c.finish_reason == "FINISH_REASON_STOP_STRING"
                stopped_by_string += 1
    assert stopped_by_string >= 1, "the cases must exercise the stop-string path"


def test_logprobs_are_streamed(client: GenerationClient) -> None:
    request = text_request("Hello", max_tokens=4, logprobs=2, prompt_logprobs=1)
    messages = list(client.stream(request))
    positions = [p for m in messages for d in m.choices for p in d.logprobs]
    assert len(positions) == 4
    assert all(p.entries[0].rank >= 1 and len(p.entries) >= 2 for p in positions)
    prompt_lps = [p for m in messages for p in m.prompt_logprobs]
    assert len(prompt_lps) == len(messages[0].prompt_token_ids) and not prompt_lps[0].entries


def test_cancel_frees_blocks_within_a_second(
    client: GenerationClient, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    before = stats(scheduler_stats).free_blocks
    call = client.stream(text_request("Count from one to one thousand: one, two,", max_tokens=400, ignore_eos=True))
    for i, _ in enumerate(call):
        if i == 5:
            break
    during = stats(scheduler_stats)
    assert during.free_blocks < before and during.running == 1
    call.cancel()
    deadline = time.monotonic() + 1.0
    while stats(scheduler_stats).free_blocks != before:
        assert time.monotonic() < deadline, "blocks not freed within 1 s of the cancellation"
        time.sleep(0.02)
    after = stats(scheduler_stats)
    assert after.running == 0 and after.num_requests == 0


def test_abort_rpc_ends_the_stream(client: GenerationClient) -> None:
    request = text_request("Write a long story about a dragon.", max_tokens=300, ignore_eos=True)
    request.request_id = "abort-me"
    call = client.stream(request)
    first = next(call)
    assert first.request_id == "abort-me"
    assert client.abort("abort-me")
    rest = list(call)
    assert rest[-1].final.choices[0].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].final.usage.completion_tokens < 300
    assert not client.abort("abort-me"), "an ended request is no longer found"


def test_tokenize_and_model_info(client: GenerationClient) -> None:
    info = client.model_info()
    assert info.model == "SmolLM2-135M-Instruct" and info.max_model_len == 8192 and info.has_chat_template
    resp = client.stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello world"))
    assert list(resp.token_ids) and len(resp.tokens) == len(resp.token_ids)


def test_scheduler_reports_prefix_cache_hits(
    client: GenerationClient, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    prompt = "Repeat after me. " * 12  # several full blocks
    client.generate(text_request(prompt, max_tokens=2))
    before = stats(scheduler_stats).prefix_cache_hits
    result = client.generate(text_request(prompt, max_tokens=2))
    assert result.final is not None and result.final.usage.cached_prompt_tokens >= 16
    assert stats(scheduler_stats).prefix_cache_hits > before


def test_cluster_health_went_not_serving_to_serving(cluster: LocalCluster) -> None:
    for name in ("worker0", "scheduler", "frontend"):
        seen = [s for s in cluster.service(name).observed if s is not None]  # NOT_SERVING while loading, then SERVING
        assert seen and seen[0] == NOT_SERVING and seen[-1] == SERVING, (name, seen)


def test_rpc_error_does_not_break_the_channel(client: GenerationClient) -> None:
    with pytest.raises(grpc.RpcError):
        list(client.stream(generation_pb2.GenerateRequest()))
    assert client.generate(text_request("Hi", max_tokens=2)).choices[0].token_ids
