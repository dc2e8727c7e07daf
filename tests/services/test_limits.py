"""Request limits (services/frontend/limits.py) and HTTP wire ranges: refused by name before any work, and the
refused request leaves nothing behind (its id is free again at once)."""

from __future__ import annotations

import grpc
import pytest
import requests

from services.client import GenerationClient, text_request
from services.frontend.limits import ApiLimits
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2
from tests.services.probes import assert_invalid_argument

pytestmark = pytest.mark.slow

L = ApiLimits()


def _req(**sampling: object) -> generation_pb2.GenerateRequest:
    return text_request("Hello", max_tokens=2, **sampling)


def _chat(n: int) -> generation_pb2.GenerateRequest:
    msgs = [generation_pb2.ChatMessage(role="user", content="hi") for _ in range(n)]
    return generation_pb2.GenerateRequest(chat=generation_pb2.ChatInput(messages=msgs))


GRPC_CASES: list[tuple[str, generation_pb2.GenerateRequest, str]] = [
    ("n above max_n", _req(n=L.max_n + 1), "n"),
    ("too many stop strings", _req(stop=[f"s{i}" for i in range(L.max_stop_strings + 1)]), "stop"),
    ("stop string too long", _req(stop=["x" * (L.max_stop_string_chars + 1)]), "stop"),
    ("too many stop token ids", _req(stop_token_ids=list(range(L.max_stop_token_ids + 1))), "stop_token_ids"),
    ("too many logit bias entries", _req(logit_bias={i: 1.0 for i in range(L.max_logit_bias + 1)}), "logit_bias"),
    ("text too long", generation_pb2.GenerateRequest(text="a" * (L.max_prompt_chars + 1)), "text"),
    ("too many chat messages", _chat(L.max_chat_messages + 1), "chat.messages"),
    ("derived seed overflows int64", _req(seed=2**63 - 1, n=2), "seed"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "field"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_limit_names_the_field(
    client: GenerationClient, case: str, request_: generation_pb2.GenerateRequest, field: str
) -> None:
    assert_invalid_argument(client, request_, field)


def test_grpc_message_above_max_request_bytes(client: GenerationClient) -> None:
    request = generation_pb2.GenerateRequest(text="a" * (L.max_request_bytes + 1))
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(request))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_long_tracestate_is_dropped_not_an_error(client: GenerationClient) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    metadata = (("traceparent", traceparent), ("tracestate", "k=" + "v" * (L.max_tracestate_chars + 1)))
    msgs = list(client.stream(text_request("Hello", max_tokens=2), metadata=metadata))
    assert msgs[-1].final.usage.completion_tokens == 2


def test_seed_at_the_int64_edge_with_n_choices_runs(client: GenerationClient) -> None:
    result = client.generate(text_request("Hello", max_tokens=2, temperature=1.0, seed=2**63 - 3, n=3))
    assert [len(c.token_ids) for c in result.choices] == [2, 2, 2]


HTTP_CASES: list[tuple[str, dict[str, object], str]] = [
    ("priority beyond int32", {"priority": 2**40}, "priority"),
    ("seed beyond int64", {"seed": 2**70}, "seed"),
    ("n beyond int32", {"n": 2**40}, "n"),
    ("max_tokens beyond int32", {"max_tokens": 2**40}, "max_tokens"),
    ("min_tokens beyond int32", {"min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    ("top_k beyond int32", {"top_k": 2**40}, "top_k"),
    ("logit bias key beyond int32", {"logit_bias": {"99999999999": 1.0}}, "logit_bias"),
    ("stop token beyond int32", {"stop_token_ids": [2**40]}, "stop_token_ids"),
    ("token id beyond int32", {"prompt": [1, 2**40]}, "prompt"),
    ("too many prompts", {"prompt": ["hi"] * (L.max_prompts + 1)}, "prompt"),
    ("too many stop strings", {"stop": ["a"] * (L.max_stop_strings + 1)}, "stop"),
    ("negative priority beyond int32", {"priority": -(2**40)}, "priority"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "extra", "field"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_out_of_range_is_400_and_frees_the_id(
    cluster: LocalCluster, case: str, extra: dict[str, object], field: str
) -> None:
    rid = f"range-{case.replace(' ', '-')}"
    body = {"prompt": "Hello", "max_tokens": 2, "request_id": rid, **extra}
    r = requests.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["param"] or "") + r.json()["error"]["message"], r.text
    # Nothing leaked: the same id is accepted right away.
    ok = requests.post(
        f"{cluster.http_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "request_id": rid}, timeout=60
    )
    assert ok.status_code == 200, ok.text


def test_http_body_above_max_request_bytes_is_413(cluster: LocalCluster) -> None:
    body = b'{"prompt": "' + b"a" * (L.max_request_bytes + 1) + b'"}'
    r = requests.post(
        f"{cluster.http_url}/v1/completions", data=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413, r.text

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(L.max_request_bytes // (1 << 20) + 1):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = requests.post(
        f"{cluster.http_url}/v1/completions", data=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 413, r.text


def test_http_sse_admission_error_has_its_status(cluster: LocalCluster) -> None:
    body = {"prompt": "Hello", "max_tokens": 2, "stream": True, "n": L.max_n + 1}
    r = requests.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    ok = requests.post(f"{cluster.http_url}/v1/completions", json={**body, "n": 1}, timeout=60, stream=True)
    assert ok.status_code == 200
    assert "data: [DONE]" in ok.text


def test_grpc_first_message_before_any_token(client: GenerationClient) -> None:
    call = client.stream(text_request("Tell me a story.", max_tokens=50, ignore_eos=True))
    first = next(call)
    assert first.prompt_token_ids  # admitted: the stream started
    call.cancel()
    assert common_pb2.FINISH_REASON_ABORT  # the cancel reaches the scheduler as an abort (see test_faults)
