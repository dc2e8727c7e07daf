"""Fuzz the public APIs: hypothesis over the gRPC request schema (edge integers, huge lists, unicode and control
characters) and schemathesis over the frontend's OpenAPI schema. Every answer is a 4xx / INVALID_ARGUMENT-like
status or a normal result: never a 500, a crash, a hang or a leaked slot. Afterwards the same greedy request still
returns the same tokens. Bounded: a fixed number of examples, each call with a deadline, valid generations cut
short (at most a few tokens, or cancelled after the first message)."""

from __future__ import annotations

import re
import time
from typing import Any

import grpc
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from services.client import GenerationClient, text_request
from services.convert.ranges import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from services.launcher import LocalCluster
from services.rpc import common_pb2, generation_pb2, scheduler_pb2_grpc
from tests.services.conftest import stats

pytestmark = pytest.mark.slow

# What a refused request may answer: each is a client error with a message, never a server fault.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
GREEDY = text_request("The capital of France is", max_tokens=8)
FUZZ_COUNTS = {"grpc": 0, "http": 0}
FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")  # messages.0.content, logit_bias.5

int32 = st.one_of(st.sampled_from([INT32_MIN, -2, -1, 0, 1, 2, 3, 16, INT32_MAX]), st.integers(INT32_MIN, INT32_MAX))
int64 = st.one_of(st.sampled_from([INT64_MIN, -1, 0, 1, INT64_MAX - 1, INT64_MAX]), st.integers(INT64_MIN, INT64_MAX))
# NOTE: proto strings are UTF-8: no lone surrogates; control characters, NUL and astral planes are all fair game.
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=64)
# Valid in float64, not in the float32 the engine samples in: subnormals, values that round to 0 or to inf in float32,
# and float32's own edges (the class of `top_p=1e-300`, which once crashed a worker step).
EXTREME_FLOATS = [
    5e-324,  # the smallest float64 subnormal
    1e-310,  # a float64 subnormal
    1e-300,  # 0 in float32
    1e-46,  # 0 in float32 (below its smallest subnormal, 1.4e-45)
    1.4e-45,  # float32's smallest subnormal
    1e-40,  # a float32 subnormal
    1.1754943508222875e-38,  # float32's smallest normal
    3.4028234663852886e38,  # float32's largest
    3.5e38,  # inf in float32
    1e300,  # inf in float32
    1.7976931348623157e308,  # float64's largest
]
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
extreme_floats = st.sampled_from([sign * x for x in EXTREME_FLOATS for sign in (1.0, -1.0)])
doubles = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, 1e-9, 1.0, 2.0, 1e308, float("nan"), float("inf")]),
    extreme_floats,
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


@st.composite
def sampling_options(draw: st.DrawFn) -> common_pb2.SamplingOptions:
    opts = common_pb2.SamplingOptions()
    for name in ("n", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "max_tokens"):
        value = draw(_maybe(int32))
        if value is not None:
            setattr(opts, name, value)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        value = draw(_maybe(doubles))
        if value is not None:
            setattr(opts, name, value)
    seed = draw(_maybe(int64))
    if seed is not None:
        opts.seed = seed
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "unlimited_max_tokens"):
        value = draw(_maybe(st.booleans()))
        if value is not None:
            setattr(opts, name, value)
    opts.stop.extend(draw(st.lists(text, max_size=20)))
    opts.stop_token_ids.extend(draw(st.lists(int32, max_size=8)))
    huge = draw(st.booleans())
    biases = draw(st.dictionaries(int32, doubles, max_size=2000 if huge else 4))
    for tok, bias in biases.items():
        opts.logit_bias[tok] = bias
    if draw(st.integers(0, 9)) == 0:
        opts.eos_token_id = draw(int32)
    opts.allowed_token_ids.extend(draw(st.lists(st.one_of(int32, st.integers(0, 1000)), max_size=8)))
    opts.bad_words.extend(draw(st.lists(text, max_size=4)))
    return opts


@st.composite
def generate_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    msg = generation_pb2.GenerateRequest(sampling=draw(sampling_options()))
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none", "long"]))
    if kind == "text":
        msg.text = draw(text)
    elif kind == "long":
        msg.text = draw(st.sampled_from(["a", "é", "\x00", "🐉 "])) * draw(st.sampled_from([2000, 300_000]))
    elif kind == "chat":
        roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), text)
        for role, content in draw(st.lists(st.tuples(roles, text), max_size=6)):
            msg.chat.messages.add(role=role, content=content)
        flag = draw(_maybe(st.booleans()))
        if flag is not None:
            msg.chat.add_generation_prompt = flag
    elif kind == "token_ids":
        msg.token_ids.ids.extend(draw(st.lists(st.one_of(int32, st.integers(0, 1000)), max_size=64)))
    msg.request_id = draw(st.one_of(st.just(""), text, st.just("x" * 300)))
    msg.priority = draw(int32)
    msg.cache_salt = draw(st.one_of(st.just(""), text))
    special = draw(_maybe(st.booleans()))
    if special is not None:
        msg.add_special_tokens = special
    return msg


@pytest.fixture(scope="module")
def greedy_before(client: GenerationClient) -> list[int]:
    return client.generate(GREEDY).choices[0].token_ids


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request_=generate_requests())
def test_grpc_fuzz_never_a_server_error(
    client: GenerationClient, greedy_before: list[int], request_: generation_pb2.GenerateRequest
) -> None:
    FUZZ_COUNTS["grpc"] += 1
    call = client.stub.Generate(request_, timeout=60)
    try:
        for i, _ in enumerate(call):
            if i >= 1:
                break  # admitted and streaming: enough (the cancel below aborts it)
    except grpc.RpcError as e:
        assert e.code() in CLIENT_ERRORS, (e.code(), e.details(), request_)
        assert e.details(), request_
    finally:
        call.cancel()


@st.composite
def extreme_sampling(draw: st.DrawFn) -> common_pb2.SamplingOptions:
    """An otherwise valid request whose float fields are extreme or ordinary: every one either passes validation and
    generates, or is refused by name; none may fail a step."""
    opts = common_pb2.SamplingOptions(max_tokens=2, seed=draw(st.integers(0, 2**31)))
    for name in FLOAT_FIELDS:
        if draw(st.booleans()):
            setattr(opts, name, draw(st.one_of(extreme_floats, st.floats(0.0, 2.0))))
    return opts


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(sampling=extreme_sampling())
@example(sampling=common_pb2.SamplingOptions(max_tokens=3, top_p=1e-300))  # the two reports, every run
@example(sampling=common_pb2.SamplingOptions(max_tokens=3, top_p=0.9, temperature=1.0, repetition_penalty=1e-40))
def test_grpc_extreme_floats_generate_or_are_refused(
    client: GenerationClient, greedy_before: list[int], sampling: common_pb2.SamplingOptions
) -> None:
    FUZZ_COUNTS["grpc"] += 1
    request_ = generation_pb2.GenerateRequest(text="The capital of France is", sampling=sampling)
    try:
        for _ in client.stub.Generate(request_, timeout=60):
            pass  # NOTE: read to the end: a failing step shows only after the first tokens
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), sampling)


@pytest.fixture(scope="module")
def openapi(cluster: LocalCluster) -> Any:
    return schemathesis.openapi.from_url(f"{cluster.http_url}/openapi.json")


def _extreme(case: Any, data: st.DataObject) -> None:
    """Some sampling fields of a body set to extreme floats (valid JSON numbers)."""
    if not isinstance(case.body, dict):
        return
    for name in FLOAT_FIELDS:
        if data.draw(st.integers(0, 3)) == 0:
            case.body[name] = data.draw(extreme_floats)
    if data.draw(st.integers(0, 7)) == 0:
        case.body["logit_bias"] = {"0": data.draw(extreme_floats)}


def _bounded(case: Any) -> None:
    """Valid generations stay short: at most 4 tokens and 4 choices (the limits are fuzzed over gRPC)."""
    if not isinstance(case.body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value > 4:
            case.body[name] = 4 if name == "max_tokens" or "max_tokens" not in case.body else None
    if isinstance(case.body.get("n"), int) and case.body["n"] > 4:
        case.body["n"] = 4
    case.body.pop("request_id", None)  # NOTE: the same drawn id twice is a correct 409, not worth the noise


@pytest.mark.parametrize(
    ("path", "method"),
    [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/health", "GET")],
)
def test_http_fuzz_never_a_server_error(cluster: LocalCluster, openapi: Any, path: str, method: str) -> None:
    operation = openapi[path][method]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(operation.as_strategy())
        _extreme(case, data)
        _bounded(case)
        FUZZ_COUNTS["http"] += 1
        response = case.call(base_url=cluster.http_url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        assert '"code":500' not in response.text.replace(" ", ""), response.text

    run()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_http_fuzz_wrong_types_are_openai_400s(cluster: LocalCluster, openapi: Any, path: str) -> None:
    """Bodies that break the schema (schemathesis' negative mode: wrong types, missing fields, out-of-schema values)
    are refused with OpenAI's error object whose param, when set, is a field path: strict types, no coercion."""
    operation = openapi[path]["POST"]

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case = data.draw(operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        _bounded(case)
        FUZZ_COUNTS["http"] += 1
        response = case.call(base_url=cluster.http_url, timeout=60)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code < 400:
            return  # NOTE: a mutation that happens to be valid (schemathesis cannot always break a schema)
        body = response.json()
        assert set(body) == {"error"}, response.text
        param = body["error"]["param"]
        assert param is None or FIELD_PATH.fullmatch(param), response.text

    run()


def test_after_fuzzing_nothing_leaked_and_greedy_unchanged(
    cluster: LocalCluster,
    client: GenerationClient,
    scheduler_stats: scheduler_pb2_grpc.SchedulerStub,
    greedy_before: list[int],
) -> None:
    deadline = time.monotonic() + 60
    while stats(scheduler_stats).num_requests and time.monotonic() < deadline:
        time.sleep(0.2)  # cancelled streams reach the scheduler as aborts, asynchronously
    s = stats(scheduler_stats)
    assert s.num_requests == 0 and s.running == 0 and s.waiting == 0
    assert all(svc.process.poll() is None for svc in cluster.services)
    assert client.generate(GREEDY).choices[0].token_ids == greedy_before
    print(f"fuzz: {FUZZ_COUNTS['grpc']} gRPC and {FUZZ_COUNTS['http']} HTTP requests")
