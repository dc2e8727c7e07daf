"""Bodies FastAPI refuses before a handler runs, and values the OpenAI models refuse, answer OpenAI's error object
(`{"error": {"message", "type", "param", "code"}}`, never FastAPI's `{"detail": ...}`) whose `param` is the field's
dotted path, or null when the body as a whole is wrong."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_core.io.tokenizer import Tokenizer
from services.frontend.http_guard import HttpConnectionLimits
from services.frontend.request import RequestError
from tests.services.http_frontend import http_frontend, post_json

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(30.0, 30.0, 0, 0)) as p:
        yield p


BAD_BODIES: list[tuple[str, str, bytes, str | None]] = [
    ("not JSON", CMPL, b"not json", None),
    ("truncated JSON", CMPL, b'{"prompt": "hi", ', None),
    ("a list, not an object", CMPL, b"[1, 2]", None),
    ("empty body", CMPL, b"", None),
    ("n: true", CMPL, b'{"prompt": "hi", "n": true}', "n"),
    ('n: "2"', CMPL, b'{"prompt": "hi", "n": "2"}', "n"),
    ("n: 2.0", CMPL, b'{"prompt": "hi", "n": 2.0}', "n"),
    ('temperature: "1"', CMPL, b'{"prompt": "hi", "temperature": "1"}', "temperature"),
    ("stream: 1", CMPL, b'{"prompt": "hi", "stream": 1}', "stream"),
    ("prompt: [true]", CMPL, b'{"prompt": [true]}', "prompt.0"),
    ("prompt: 5", CMPL, b'{"prompt": 5}', "prompt"),
    ("prompt missing", CMPL, b'{"max_tokens": 3}', "prompt"),
    ("unknown field", CMPL, b'{"prompt": "hi", "temprature": 1}', "temprature"),
    ("lone surrogate in prompt", CMPL, b'{"prompt": "hi \\ud800"}', "prompt"),
    ("lone surrogate in stop", CMPL, b'{"prompt": "hi", "stop": ["a", "\\udfff"]}', "stop"),
    ("lone surrogate in a logit_bias key", CMPL, b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("logit_bias key with spaces", CMPL, b'{"prompt": "hi", "logit_bias": {" 5 ": 1}}', "logit_bias"),
    ("logit_bias key with underscore", CMPL, b'{"prompt": "hi", "logit_bias": {"1_0": 1}}', "logit_bias"),
    ("logit_bias key in Arabic-Indic digits", CMPL, '{"prompt": "hi", "logit_bias": {"٥": 1}}'.encode(), "logit_bias"),
    ("logit_bias key with a sign", CMPL, b'{"prompt": "hi", "logit_bias": {"+5": 1}}', "logit_bias"),
    ("logit_bias value a string", CMPL, b'{"prompt": "hi", "logit_bias": {"5": "x"}}', "logit_bias.5"),
    ("logit_bias value a string, odd key", CMPL, b'{"prompt": "hi", "logit_bias": {"a.b": "x"}}', "logit_bias"),
    ("unknown field with an odd name", CMPL, b'{"prompt": "hi", "a b.c": 1}', None),
    ("content a number", CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content"),
    ("surrogate in content", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
    (
        "lone surrogate in a content part",
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages.0.content.0.text",
    ),
    ("role missing", CHAT, b'{"messages": [{"content": "hi"}]}', "messages.0.role"),
    ("logprobs: 1", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}', "logprobs"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "param"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_is_400_with_openai_error(port: int, case: str, path: str, body: bytes, param: str | None) -> None:
    status, answer = post_json(port, path, body)
    assert status == 400, answer
    assert set(answer) == {"error"}, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400, error
    assert error["param"] == param, error
    assert error["message"], error


def test_valid_values_still_pass_validation(port: int) -> None:
    """Strict types keep what OpenAI accepts: an integer temperature, token-id prompts, canonical logit_bias keys.
    They pass every check and reach the scheduler (not running here: 503)."""
    body = b'{"prompt": [1, 2, 3], "temperature": 1, "top_p": 1, "logit_bias": {"0": 1, "15": -2.5}, "max_tokens": 2}'
    status, answer = post_json(port, CMPL, body)
    assert status == 503, answer
    chat = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}'
    status, answer = post_json(port, CHAT, chat)
    assert status == 503, answer


def test_unknown_route_and_method_answer_the_openai_shape(port: int) -> None:
    status, answer = post_json(port, "/v1/nothing", b"{}")
    assert status == 404 and answer["error"]["code"] == 404, answer
    status, answer = post_json(port, "/v1/models", b"{}")
    assert status == 405 and answer["error"]["code"] == 405 and answer["error"]["param"] is None, answer


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("top_p must be in (0, 1]", "top_p"),
        ("messages[2].role must be one of ...", "messages.2.role"),
        ("Field required", None),
        ("Input should be a valid integer", None),
        ("31: JSON decode error", None),
    ],
)
def test_a_param_is_derived_only_from_a_field_path(message: str, param: str | None) -> None:
    assert RequestError.invalid(message).param == param
