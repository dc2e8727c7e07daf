"""vLLM's request surface beyond OpenAI's, over the real HTTP server without a scheduler: `/tokenize`,
`/detokenize` and the checks of `truncate_prompt_tokens` (what needs generation is in test_openai_extras.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from engine_core.io.tokenizer import Tokenizer
from services.frontend.http_guard import HttpConnectionLimits
from tests.services.http_frontend import MAX_MODEL_LEN, http_frontend, post_json

CMPL = "/v1/completions"
CHAT: Any = [{"role": "user", "content": "Hello there <|im_end|>"}]


@pytest.fixture(scope="module")
def port(smollm2_tokenizer: Tokenizer) -> Iterator[int]:
    with http_frontend(smollm2_tokenizer, HttpConnectionLimits(30.0, 30.0, 0, 0)) as p:
        yield p


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return post_json(port, path, json.dumps(body).encode())


def test_tokenize_text_and_chat_as_vllm(port: int, smollm2_tokenizer: Tokenizer) -> None:
    text = "The capital of France is"
    status, reply = _post(port, "/tokenize", {"prompt": text, "return_token_strs": True})
    ids = smollm2_tokenizer.encode(text)
    assert status == 200 and reply == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": smollm2_tokenizer.convert_ids_to_tokens(ids),
    }
    status, reply = _post(port, "/tokenize", {"messages": CHAT})
    # the chat template, with special-token text in a message read as text (as generation reads it)
    assert status == 200 and reply["tokens"] == smollm2_tokenizer.apply_chat_template(CHAT)
    assert reply["token_strs"] is None and reply["count"] == len(reply["tokens"])
    status, reply = _post(port, "/detokenize", {"tokens": ids})
    assert status == 200 and reply == {"prompt": smollm2_tokenizer.decode(ids)}


BAD: list[tuple[str, str, bytes, str | None]] = [
    ("id outside the vocabulary", "/detokenize", b'{"tokens": [1, 99999999]}', "tokens"),
    ("negative id", "/detokenize", b'{"tokens": [-1]}', "tokens"),
    ("ids not ints", "/detokenize", b'{"tokens": ["a"]}', "tokens.0"),
    ("unknown field", "/tokenize", b'{"prompt": "x", "promt": 1}', "promt"),
    ("lone surrogate", "/tokenize", b'{"prompt": "x \\ud800"}', "prompt"),
    ("wrong model", "/tokenize", b'{"prompt": "x", "model": "gpt-4"}', "model"),
    ("truncate 0", CMPL, b'{"prompt": "x", "truncate_prompt_tokens": 0}', "truncate_prompt_tokens"),
    ("truncate too long", CMPL, b'{"prompt": "x", "truncate_prompt_tokens": 4096}', "truncate_prompt_tokens"),
    ("prompt_logprobs streamed", CMPL, b'{"prompt": "x", "prompt_logprobs": 1, "stream": true}', "prompt_logprobs"),
    ("lone surrogate, completions", CMPL, b'{"prompt": "\\ud800"}', "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "path", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_4xx_naming_the_field(port: int, case: str, path: str, body: bytes, param: str) -> None:
    status, reply = post_json(port, path, body)
    assert status in (400, 404), (case, reply)
    assert reply["error"]["param"] == param, (case, reply)


def test_truncation_keeps_the_tail(smollm2_tokenizer: Tokenizer) -> None:
    from services.frontend.request import PromptInput
    from services.frontend.tokenization import PromptTokenizer

    tok = PromptTokenizer(smollm2_tokenizer, 49152, MAX_MODEL_LEN)
    text = "one two three four five six seven"
    ids = smollm2_tokenizer.encode(text)
    assert tok.encode(PromptInput(text=text, truncate_prompt_tokens=3)) == (None, ids[-3:])
    assert tok.encode(PromptInput(text=text, truncate_prompt_tokens=-1)) == (text, ids)  # max_model_len: all of it
    assert tok.encode(PromptInput(token_ids=ids, truncate_prompt_tokens=100)) == (None, ids)
