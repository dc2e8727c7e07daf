"""Bad requests: each field -> INVALID_ARGUMENT naming it; the server keeps serving."""

from __future__ import annotations

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.rpc import common_pb2, generation_pb2
from tests.services.probes import assert_invalid_argument

pytestmark = pytest.mark.slow


def _req(**sampling: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingOptions(**sampling))  # type: ignore[arg-type]


def _chat(*messages: tuple[str, str]) -> generation_pb2.GenerateRequest:
    chat = generation_pb2.ChatInput(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages])
    return generation_pb2.GenerateRequest(chat=chat)


def _ids(*ids: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(ids)))


BAD_REQUESTS: list[tuple[str, generation_pb2.GenerateRequest, str]] = [
    ("negative temperature", _req(temperature=-1.0), "temperature"),
    ("top_p zero", _req(top_p=0.0), "top_p"),
    ("top_k negative", _req(top_k=-5), "top_k"),
    ("min_p above one", _req(min_p=1.5), "min_p"),
    ("n zero", _req(n=0), "n"),
    ("n above max_num_seqs", _req(n=1000), "n"),
    ("max_tokens zero", _req(max_tokens=0), "max_tokens"),
    ("min_tokens above max_tokens", _req(max_tokens=4, min_tokens=8), "min_tokens"),
    ("unlimited and max_tokens", _req(max_tokens=4, unlimited_max_tokens=True), "max_tokens"),
    ("logprobs too many", _req(logprobs=21), "logprobs"),
    ("prompt_logprobs too many", _req(prompt_logprobs=99), "prompt_logprobs"),
    ("empty stop string", _req(stop=[""]), "stop"),
    ("stop token outside vocab", _req(stop_token_ids=[10**6]), "stop_token_ids"),
    ("logit bias too large", _req(logit_bias={5: 500.0}), "logit_bias"),
    ("logit bias token outside vocab", _req(logit_bias={10**6: 1.0}), "logit_bias"),
    ("frequency penalty", _req(frequency_penalty=3.0), "frequency_penalty"),
    ("presence penalty", _req(presence_penalty=-3.0), "presence_penalty"),
    ("repetition penalty", _req(repetition_penalty=0.0), "repetition_penalty"),
    ("eos set by the client", _req(eos_token_id=3), "eos_token_id"),
    ("no input", generation_pb2.GenerateRequest(), "input"),
    ("empty text", generation_pb2.GenerateRequest(text=""), "text"),
    ("token id outside vocab", _ids(1, 10**6), "token_ids"),
    ("no chat messages", _chat(), "chat.messages"),
    ("bad chat role", _chat(("wizard", "hi")), "role"),
    ("request id too long", generation_pb2.GenerateRequest(text="Hi", request_id="x" * 300), "request_id"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "request_", "field"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_invalid_argument(
    client: GenerationClient, case: str, request_: generation_pb2.GenerateRequest, field: str
) -> None:
    assert_invalid_argument(client, request_, field)


def test_too_long_prompt_names_both_lengths(client: GenerationClient) -> None:
    text = "hello " * 9000
    n = len(client.stub.Tokenize(generation_pb2.TokenizeRequest(text=text)).token_ids)
    max_len = client.model_info().max_model_len
    assert n >= max_len
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(generation_pb2.GenerateRequest(text=text)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(n) in info.value.details() and str(max_len) in info.value.details(), info.value.details()


def test_duplicate_request_id_is_refused(client: GenerationClient) -> None:
    request = text_request("Tell me a long story.", max_tokens=200, ignore_eos=True)
    request.request_id = "same-id"
    call = client.stream(request)
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(request))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()


def test_server_still_serves_after_bad_requests(client: GenerationClient) -> None:
    result = client.generate(text_request("The capital of France is", max_tokens=4))
    assert len(result.choices[0].token_ids) == 4
