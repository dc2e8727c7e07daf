"""SamplingParams validation: every bad value raises a ValueError whose message starts with the field's name."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine_core.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    SamplingParams,
    with_eos,
)

BAD: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("n", {"n": True}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": math.nan}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -3.0}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 10, "max_tokens": 5}),
    ("stop", {"stop": 5}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": ["ok", None]}),
    ("stop", {"stop": [""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["2"]}),
    ("stop_token_ids", {"stop_token_ids": 2}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": 100}),
    ("logit_bias", {"logit_bias": {5: 100.5}}),
    ("logit_bias", {"logit_bias": {5: -101}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),
    ("logit_bias", {"logit_bias": {5: math.nan}}),
    ("logit_bias", {"logit_bias": [(5, 1.0)]}),
    ("seed", {"seed": 1.5}),
    # validated in float32, the precision the sampler uses: 0 after rounding, or not finite
    ("top_p", {"top_p": 1e-300}),
    ("top_p", {"top_p": 1e-46}),
    ("repetition_penalty", {"repetition_penalty": 1e-46}),
    ("temperature", {"temperature": 1e39}),
    ("repetition_penalty", {"repetition_penalty": 3.5e38}),
    ("bad_words", {"bad_words": "word"}),
    ("bad_words", {"bad_words": ["ok", 5]}),
    ("bad_words", {"bad_words": ["  "]}),
    ("bad_words", {"bad_words": ["x" * (MAX_BAD_WORD_CHARS + 1)]}),
    ("bad_words", {"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [-1]}),
    ("allowed_token_ids", {"allowed_token_ids": [True]}),
    ("allowed_token_ids", {"allowed_token_ids": 5}),
    ("allowed_token_ids", {"allowed_token_ids": [1] * (MAX_ALLOWED_TOKEN_IDS + 1)}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[]]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[-3]]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[1] * (MAX_BAD_WORD_TOKENS + 1)]}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_parameters_name_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_valid_edge_values_are_accepted_and_normalised() -> None:
    p = SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        stop="###",
        logprobs=20,
        logit_bias={3: -100, 4: 100.0},
        min_tokens=16,
        max_tokens=16,
        frequency_penalty=-2,
        presence_penalty=2,
    )
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.greedy
    assert not SamplingParams(temperature=1e-5).greedy and SamplingParams(temperature=9e-6).greedy
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_stop_token_ids_and_vocab_checks() -> None:
    p = SamplingParams(stop_token_ids=[7, 9], eos_token_id=2)
    assert p.all_stop_token_ids == {2, 7, 9}
    assert SamplingParams(stop_token_ids=[7], eos_token_id=2, ignore_eos=True).all_stop_token_ids == {7}
    p.validate_vocab(10)
    with pytest.raises(ValueError, match=r"^stop_token_ids"):
        p.validate_vocab(8)
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias={50: 1.0}).validate_vocab(50)


def test_float32_edges_that_stay_usable_are_accepted() -> None:
    # subnormal in float32 but not 0: valid, and the sampler copes (tests/test_logits_processors.py)
    assert SamplingParams(top_p=1e-40).top_p == 1e-40
    assert SamplingParams(repetition_penalty=1e-40, temperature=3.4e38, min_p=1e-300).min_p == 1e-300


def test_every_token_id_that_reaches_the_sampler_is_checked_against_the_vocabulary() -> None:
    cases = [
        ("allowed_token_ids", SamplingParams(allowed_token_ids=[3, 10])),
        ("bad_words", SamplingParams(bad_words_token_ids=[[1, 2], [10]])),
        ("eos_token_id", SamplingParams(min_tokens=2, eos_token_id=2**31 - 1)),
        ("eos_token_id", SamplingParams(eos_token_id=-1)),
    ]
    for field, params in cases:
        with pytest.raises(ValueError, match=rf"^{field}\b"):
            params.validate_vocab(10)
    with pytest.raises(ValueError, match=r"^eos_token_id"):
        with_eos(SamplingParams(), 10, 10)
    # a request that could never sample a token is refused up front
    for params in (
        SamplingParams(allowed_token_ids=[4], bad_words_token_ids=[[4], [5, 6]]),
        SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], min_tokens=1, eos_token_id=2),
    ):
        with pytest.raises(ValueError, match=r"^allowed_token_ids"):
            params.validate_vocab(10)
    SamplingParams(allowed_token_ids=[4], bad_words_token_ids=[[4, 4]]).validate_vocab(10)  # fine at first
    SamplingParams(allowed_token_ids=[2, 7], stop_token_ids=[7], eos_token_id=2).validate_vocab(10)
    copy = with_eos(SamplingParams(bad_words=["x"]), 2, 10, [[4, 5]])
    assert copy.eos_token_id == 2 and copy.bad_words_token_ids == [[4, 5]]
