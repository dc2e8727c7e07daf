"""vLLM's response extras through the three services: `prompt_logprobs`, `echo` with `logprobs`,
`return_token_ids`, `truncate_prompt_tokens` and `stream_options.continuous_usage_stats`, as raw JSON."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import pytest

from engine_core.io.tokenizer import Tokenizer
from services.launcher import LocalCluster

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT: Any = [{"role": "user", "content": "Name a colour."}]


class Http:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Http:
    return Http(cluster.http_url)


def _post(client: Http, path: str, body: dict[str, Any]) -> Any:
    status, raw = client.post(path, {"temperature": 0, **body} if path.startswith("/v1") else body)
    assert status == 200, raw
    return json.loads(raw)


def _stream(client: Http, path: str, body: dict[str, Any]) -> list[Any]:
    status, raw = client.post(path, {"temperature": 0, "stream": True, **body})
    assert status == 200, raw
    lines = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_prompt_logprobs_and_echo_logprobs(client: Http, smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode(PROMPT)
    body = _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 2})
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tok, pos in zip(ids[1:], plp[1:], strict=True):
        assert str(tok) in pos and 1 <= len(pos) <= 3  # the prompt's token, and the top 2
        assert all(set(v) == {"logprob", "rank", "decoded_token"} and v["logprob"] <= 0 for v in pos.values())
    assert pos[str(tok)]["decoded_token"] == smollm2_tokenizer.decode([tok])
    echo = _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1})
    choice = echo["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and choice["prompt_logprobs"] is None  # not asked for
    assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1] == pytest.approx(plp[1][str(ids[1])]["logprob"], abs=1e-4)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chat = _post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_return_token_ids(client: Http, smollm2_tokenizer: Tokenizer) -> None:
    body = _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == smollm2_tokenizer.encode(PROMPT)
    assert len(choice["token_ids"]) == 4 and smollm2_tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = _stream(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "return_token_ids": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"] or []] == choice["token_ids"]
    chat = _post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "return_token_ids": True})
    assert chat["prompt_token_ids"] == smollm2_tokenizer.apply_chat_template(CHAT)
    out = chat["choices"][0]
    assert smollm2_tokenizer.decode(out["token_ids"], skip_special_tokens=True) == out["message"]["content"]
    chunks = _stream(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"] or []] == out["token_ids"]


def test_truncate_prompt_tokens(client: Http, smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode(PROMPT)
    cut = _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "truncate_prompt_tokens": 2})
    same = _post(client, "/v1/completions", {"prompt": ids[-2:], "max_tokens": 3})
    assert cut["usage"]["prompt_tokens"] == 2 and cut["choices"][0]["text"] == same["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(client: Http, path: str) -> None:
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _stream(client, path, {**prompt, "max_tokens": 5, "ignore_eos": True, "stream_options": options})
    final = chunks[-1]["usage"]
    running = [c["usage"] for c in chunks[:-1] if c["choices"] and c["usage"] is not None]
    assert running and all(u["prompt_tokens"] == final["prompt_tokens"] for u in running)
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == final["completion_tokens"] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)
    # without continuous_usage_stats, only the last chunk has usage
    plain = _stream(client, path, {**prompt, "max_tokens": 5, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])


def test_tokenize_round_trip_through_the_cluster(client: Http) -> None:
    ids = _post(client, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert _post(client, "/detokenize", {"tokens": ids}) == {"prompt": PROMPT}
