"""Bad requests: each field -> INVALID_ARGUMENT naming it; the server keeps serving."""

from __future__ import annotations

import grpc
import pytest

from services.client import GenerationClient, text_request
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2, scheduler_pb2, scheduler_pb2_grpc
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
    # float32: the sampler's precision (these crashed a step before)
    ("top_p rounds to 0 in float32", _req(top_p=1e-300), "top_p"),
    ("repetition penalty rounds to 0", _req(repetition_penalty=1e-46, top_p=0.9), "repetition_penalty"),
    ("temperature overflows float32", _req(temperature=1e39), "temperature"),
    ("allowed token outside vocab", _req(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    ("allowed token negative", _req(allowed_token_ids=[-1]), "allowed_token_ids"),
    ("too many bad words", _req(bad_words=["w"] * 129), "bad_words"),
    ("blank bad word", _req(bad_words=[" "]), "bad_words"),
    ("every allowed token a bad word", _req(allowed_token_ids=[28], bad_words=[","]), "allowed_token_ids"),
    ("bad word ids set by the client", _req(bad_words_token_ids=[common_pb2.TokenIdSequence(token_ids=[1])]),
     "bad_words_token_ids"),
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


def test_bad_words_and_allowed_token_ids_shape_the_output(client: GenerationClient) -> None:
    plain = client.generate(text_request("The capital of France is", max_tokens=6)).choices[0]
    allowed = sorted(set(plain.token_ids))[:2]
    only = client.generate(text_request("The capital of France is", max_tokens=6, allowed_token_ids=allowed))
    assert set(only.choices[0].token_ids) <= set(allowed)
    word = plain.text.split()[0]
    banned = client.generate(text_request("The capital of France is", max_tokens=6, bad_words=[word]))
    assert word not in banned.choices[0].text.split()


def test_scheduler_submit_checks_token_ids_against_the_model(cluster: LocalCluster, client: GenerationClient) -> None:
    """The scheduler's own Submit is an entry point too: every token id that reaches the worker is range-checked
    there, and a refused request leaves a running neighbour's stream as it would be alone."""
    request = text_request("Tell me a long story.", max_tokens=24, ignore_eos=True)
    expected = client.generate(request).choices[0].token_ids
    neighbour = client.stream(request)
    got: list[int] = []
    while not got:  # running: its first tokens are out
        got += [t for choice in next(neighbour).choices for t in choice.token_ids]
    big = 2**31 - 1
    cases = [
        ("eos_token_id", common_pb2.SamplingOptions(eos_token_id=big, min_tokens=2, max_tokens=4)),
        ("allowed_token_ids", common_pb2.SamplingOptions(allowed_token_ids=[big])),
        ("bad_words", common_pb2.SamplingOptions(bad_words_token_ids=[common_pb2.TokenIdSequence(token_ids=[big])])),
        ("logit_bias", common_pb2.SamplingOptions(logit_bias={big: 1.0})),
        ("stop_token_ids", common_pb2.SamplingOptions(stop_token_ids=[big], min_tokens=1)),
        ("prompt_token_ids", common_pb2.SamplingOptions()),
    ]
    with grpc.insecure_channel(cluster.scheduler_addr) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for field, opts in cases:
            prompt = [1, 2, big] if field == "prompt_token_ids" else [1, 2, 3]
            submit = scheduler_pb2.SubmitRequest(request_id=f"direct-{field}", prompt_token_ids=prompt, sampling=opts)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Submit(submit, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value.details())
            assert info.value.details().startswith(field), info.value.details()
    for msg in neighbour:
        for choice in msg.choices:
            got.extend(choice.token_ids)
    assert got == list(expected)


def test_a_request_with_nothing_left_to_sample_fails_alone_with_internal(client: GenerationClient) -> None:
    """A row the sampler cannot sample (here its allowed_token_ids are all bad words) fails its own request with
    INTERNAL, not the retryable UNAVAILABLE; the step's other rows go on."""
    request = text_request("Tell me a long story.", max_tokens=16, ignore_eos=True)
    expected = client.generate(request).choices[0].token_ids
    neighbour = client.stream(request)
    got: list[int] = []
    while not got:
        got += [t for choice in next(neighbour).choices for t in choice.token_ids]
    seven = client.stub.Tokenize(generation_pb2.TokenizeRequest(text="7")).token_ids[-1]
    # only "7" is allowed and "77" is a bad word ("7" "7"): after the first 7 nothing is left to sample
    with pytest.raises(grpc.RpcError) as info:
        list(client.stream(text_request("Hi", max_tokens=4, allowed_token_ids=[seven], bad_words=["77"])))
    assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
    assert "no token can be sampled" in info.value.details()
    for msg in neighbour:
        got += [t for choice in msg.choices for t in choice.token_ids]
    assert got == list(expected)
