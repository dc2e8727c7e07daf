"""The unmodified `openai` client against the frontend's HTTP API: completions and chat, streaming and not."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from services.launcher import LocalCluster
from services.rpc import scheduler_pb2_grpc
from tests.services.conftest import stats

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def oai(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_models(oai: openai.OpenAI) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_completions_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    prompt = "The three primary colors are"
    full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens_details is not None and full.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_logprobs_and_batch(oai: openai.OpenAI) -> None:
    resp = oai.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0, logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    lp = resp.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 3 and len(lp.top_logprobs or []) == 3


def test_chat_stream_equals_non_stream(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.prompt_tokens_details is not None
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same conversation again: its prompt is now in the prefix cache.
    again = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_logprobs(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say yes."}]
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,  # type: ignore[arg-type]
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_http_errors_name_the_field(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=-1)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="Hi", extra_body={"no_such_field": 1})
    assert "no_such_field" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)


def test_vllm_sampling_extensions_and_float32_limits(oai: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    word = plain.choices[0].text.split()[0]
    banned = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"bad_words": [word]}
    )
    assert word not in banned.choices[0].text.split()
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=4,
        extra_body={"allowed_token_ids": [28, 29], "ignore_eos": True},
    )
    assert chat.choices[0].message.content is not None and set(chat.choices[0].message.content) <= {",", "-"}
    for body, field in (
        ({"top_p": 1e-300}, "top_p"),
        ({"repetition_penalty": 1e-46}, "repetition_penalty"),
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body=body)
        assert info.value.body["param"] == field, info.value.body  # type: ignore[index]
    # a request the sampler cannot continue ("7" allowed, "77" banned) fails alone: a 500 with OpenAI's error object
    sevens = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"allowed_token_ids": [39]})
    assert sevens.choices[0].text == "77"  # token 39 is "7"
    with pytest.raises(openai.InternalServerError) as error:
        oai.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"allowed_token_ids": [39], "bad_words": ["77"]}
        )
    assert "no token can be sampled" in error.value.body["message"]  # type: ignore[index]


def test_dropped_sse_connection_aborts_the_request(
    oai: openai.OpenAI, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    before = stats(scheduler_stats).free_blocks
    stream = oai.completions.create(
        model=MODEL, prompt="Count to a thousand:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert stats(scheduler_stats).running == 1
    stream.close()  # drops the HTTP connection
    deadline = time.monotonic() + 2.0
    while stats(scheduler_stats).free_blocks != before:
        assert time.monotonic() < deadline, "the request kept running after the client went away"
        time.sleep(0.05)


def test_beam_search_over_completions_and_chat(oai: openai.OpenAI) -> None:
    """vLLM's extension fields: use_beam_search, best_of = the width, n = the hypotheses returned; the answer is the
    search's final beams (a stream sends them at its end)."""
    body = {"use_beam_search": True, "length_penalty": 1.0, "ignore_eos": True}
    out = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, n=2, best_of=4,
                                 extra_body=body)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text and all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 12
    streamed = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, n=2, best_of=4,
                                      stream=True, extra_body=body)  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, n=2,
        extra_body={"use_beam_search": True, "early_stopping": True},
    )  # fmt: skip
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    for extra, field in (
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"best_of": 2, "n": 3}, "n"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ):
        kwargs: dict = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "extra_body": {**body}}
        kwargs.update({k: v for k, v in extra.items() if k in ("temperature", "logprobs", "best_of", "n")})
        kwargs["extra_body"].update({k: v for k, v in extra.items() if k == "early_stopping"})
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(**kwargs)
        assert info.value.body["param"] == field, info.value.body  # type: ignore[index]
