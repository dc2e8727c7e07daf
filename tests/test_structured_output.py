"""Structured output enforced in the engine: each constraint kind's outputs parse/match (n > 1, sampled and greedy),
the matcher rebuilt after preemption, max_tokens mid-object, bad and hostile constraints refused by field, and a
constraint that cannot go on failing its request alone (nothing leaked). A tiny random model with a real tokenizer:
every token it samples is the grammar's doing, not the model's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from engine_core import LLM, SamplingParams, StructuredOutputsParams
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sampling_params import with_eos
from engine_core.structured_output.guidance import backend_for_model
from engine_core.structured_output.params import MAX_SCHEMA_DEPTH

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "score": {"anyOf": [{"type": "number", "minimum": -1.5, "maximum": 2.5}, {"type": "null"}]},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
        },
        "required": ["tags", "code", "score", "inner"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def llm(tiny_vocab_dir: Path) -> LLM:
    return LLM(str(tiny_vocab_dir), kv_cache_memory=0.05, max_model_len=512)


def assert_idle(llm: LLM) -> None:
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not llm.core.scheduler.requests


def generate(llm: LLM, so: StructuredOutputsParams, **kw: object) -> list[tuple[str, str | None]]:
    params = SamplingParams(structured_outputs=so, **kw)  # type: ignore[arg-type]
    out = llm.generate(["Answer:"], params, use_tqdm=False)[0]
    return [(c.text, c.finish_reason) for c in out.outputs]


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, schema: dict, temperature: float) -> None:
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = generate(llm, so, n=4, temperature=temperature, seed=3, max_tokens=200)
    for text, reason in outs:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert_idle(llm)


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    for text, reason in generate(
        llm, StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2,4}"), n=4, seed=1, max_tokens=30
    ):
        assert reason == "stop" and re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", text), text
    choices = ["yes", "no", "perhaps not"]
    picked = generate(llm, StructuredOutputsParams(choice=choices), n=6, seed=2, max_tokens=30)
    assert all(reason == "stop" and text in choices for text, reason in picked)
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    for text, reason in generate(llm, StructuredOutputsParams(grammar=lark), n=3, seed=4, max_tokens=40):
        assert reason == "stop" and re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text), text
    gbnf = 'root ::= "x" [0-9] [0-9]'
    for text, reason in generate(llm, StructuredOutputsParams(grammar=gbnf), n=2, seed=5, max_tokens=40):
        assert reason == "stop" and re.fullmatch(r"x\d\d", text), text
    # any JSON object: a random model rambles inside strings, so only a finished one must parse
    for text, reason in generate(
        llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), n=4, seed=6, max_tokens=64
    ):
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
    assert_idle(llm)


def test_max_tokens_mid_object_ends_with_length(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SCHEMAS[1], disable_any_whitespace=True)
    ((text, reason),) = generate(llm, so, temperature=0.0, max_tokens=5)
    assert reason == "length" and text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert_idle(llm)


def test_seeded_and_logprobs_are_unchanged_by_the_mask(llm: LLM) -> None:
    so = StructuredOutputsParams(regex=r"[0-9]{6}")
    params = SamplingParams(structured_outputs=so, seed=11, temperature=1.0, max_tokens=12, logprobs=2)
    first = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    mates = [SamplingParams(temperature=1.0, max_tokens=12), params]
    again = llm.generate(["Other prompt", "Answer:"], mates, use_tqdm=False)[1].outputs[0]
    assert first.token_ids == again.token_ids  # a seed gives the same constrained output beside other requests
    # logprobs are of the raw logits: a digit the grammar forced may be far from the raw top
    assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
    assert_idle(llm)


def test_preemption_rebuilds_the_matcher(tiny_vocab_dir: Path) -> None:
    so = StructuredOutputsParams(regex=r"[a-z]{60,80}\.")
    params = SamplingParams(structured_outputs=so, temperature=0.0, max_tokens=120)
    prompts = [f"Prompt number {i}:" for i in range(8)]
    roomy = LLM(str(tiny_vocab_dir), kv_cache_memory=0.05, max_model_len=512)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    tight = LLM(str(tiny_vocab_dir), num_kv_blocks=14, max_num_batched_tokens=128, max_model_len=512)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.core.stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference  # replayed matchers pick the same greedy tokens
    for o in outs:
        assert re.fullmatch(r"[a-z]{60,80}\.", o.outputs[0].text), o.outputs[0].text
    assert_idle(tight)


def test_the_tokenizer_is_built_by_the_first_constrained_request(tiny_vocab_dir: Path) -> None:
    """An engine that never sees a constraint never holds llguidance's tokenizer (~35 MB for SmolLM2's vocabulary)."""
    backend = backend_for_model(tiny_vocab_dir, 49152, 2)
    assert backend is not None
    assert backend._tokenizer is None
    backend.prepare(StructuredOutputsParams(regex="[ab]{2}")).result(timeout=120)
    assert backend._tokenizer is not None
    built = backend._tokenizer
    backend.prepare(StructuredOutputsParams(regex="[cd]{2}")).result(timeout=120)
    assert backend._tokenizer is built  # once


def test_matcher_replay_equals_the_live_matcher(tiny_vocab_dir: Path) -> None:
    """What a resumed (preempted) sequence gets: the same mask as the matcher that consumed the tokens live."""
    backend = backend_for_model(tiny_vocab_dir, 49152, 2)
    assert backend is not None
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]), max_tokens=64)
    batch = SamplingBatch(49152, "cpu", 4, seed=0, grammar_backend=backend)
    batch.add(0, params, None, [1], [])
    gen = torch.Generator().manual_seed(0)
    tokens: list[int] = []
    for _ in range(6):
        logits = torch.randn(1, 49152, generator=gen)
        batch.metadata([0]).processors[0].apply(logits)
        token = int(logits.argmax())
        tokens.append(token)
        batch.append_tokens([0], torch.tensor([token]), np.array([token]))
    live = batch.structured_output.masks([batch._slots[0]]).copy()
    batch.remove(0)
    batch.add(7, params, None, [1], tokens)
    assert np.array_equal(batch.structured_output.masks([batch._slots[7]]), live)


def test_bad_constraints_are_refused_naming_the_field(llm: LLM) -> None:
    cases = [
        ({"json": {"type": "objectx"}}, r"^structured_outputs\.json is invalid: .*objectx"),
        ({"json": {"type": "string", "format": "no-such"}}, r"^structured_outputs\.json is invalid"),
        ({"json": "{not json"}, r"^structured_outputs\.json is not valid JSON"),
        ({"regex": "((("}, r"^structured_outputs\.regex is invalid"),
        ({"grammar": "start: undefined_rule"}, r"^structured_outputs\.grammar is invalid"),
        ({"json": {"type": "string", "pattern": "(("}}, r"^structured_outputs\.json is invalid"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    for kwargs, match in [
        ({}, r"exactly one of"),
        ({"regex": "a", "choice": ["a"]}, r"exactly one of"),
        ({"choice": []}, r"^structured_outputs\.choice"),
        ({"regex": "a" * 20000}, r"^structured_outputs\.regex has 20000 characters"),
        ({"grammar": "x" * 70000}, r"^structured_outputs\.grammar has"),
        ({"json": "[" * 10**6}, r"^structured_outputs\.json has"),
        ({"choice": ["a"] * 2000}, r"^structured_outputs\.choice must hold at most"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match=r"nests deeper than"):
        StructuredOutputsParams(json=deep)
    with pytest.raises(ValueError, match=r"nests deeper than"):
        StructuredOutputsParams(json="[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match=r"^structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    assert_idle(llm)


def test_hostile_constraints_are_bounded(llm: LLM) -> None:
    """Inside the size limits, a constraint whose automaton explodes is stopped by llguidance's fuel limits with an
    error (or served): never an unbounded compile."""
    for so in (
        StructuredOutputsParams(regex="(a|aa)*" + "(a{1,100}){1,100}" * 20),
        StructuredOutputsParams(json={"type": "string", "pattern": "^((a+)+b){1,50}$"}),
    ):
        params = SamplingParams(structured_outputs=so, max_tokens=4)
        try:
            outs = llm.generate("Hi", params, use_tqdm=False)
        except ValueError as e:
            assert str(e).startswith(("structured_outputs.regex", "structured_outputs.json")), e
        else:
            assert outs[0].outputs[0].finish_reason in ("stop", "length", "error")
    assert_idle(llm)


def test_a_constraint_that_cannot_go_on_fails_its_request_alone(llm: LLM) -> None:
    digits = StructuredOutputsParams(regex=r"[0-9]{4}")
    comma = llm.tokenizer.encode(",", add_special_tokens=False)[-1]
    # the grammar allows digits, allowed_token_ids only a comma: nothing can be sampled
    stuck = SamplingParams(structured_outputs=digits, allowed_token_ids=[comma], max_tokens=8)
    fine = SamplingParams(structured_outputs=digits, temperature=0.0, max_tokens=8)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["Answer:"], plain, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["Answer:"] * 3, [stuck, fine, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert re.fullmatch(r"[0-9]{4}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].token_ids == alone
    # a constraint that reaches the engine without the frontend's check fails in the worker, alone
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="((("), max_tokens=4)
    params = with_eos(SamplingParams(max_tokens=4), 2, 49152)
    bad.eos_token_id = 2
    ids = llm.tokenizer.encode("Answer:")
    llm.core.add_request(Request("bad", ids, bad))
    llm.core.add_request(Request("good", ids, params))
    finished: dict[str, SeqOutput] = {}
    while llm.core.has_unfinished:
        for out in llm.core.step():
            if out.finish_reason is not None:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason is FinishReason.ERROR
    assert "structured_outputs.regex is invalid" in finished["bad"].error
    assert finished["good"].finish_reason is FinishReason.LENGTH
    assert_idle(llm)


def test_speculative_decoding_leaves_constrained_requests_unchanged(llm: LLM, tiny_vocab_dir: Path) -> None:
    # NOTE: a constrained request decodes one token per step beside speculated neighbours (spec_decode/drafter.py):
    # both kinds in one batch give what the engine gives without drafts.
    spec = LLM(
        str(tiny_vocab_dir),
        kv_cache_memory=0.05,
        max_model_len=512,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    so = StructuredOutputsParams(regex=r"(ab|cd){2,6}x")
    prompts = ["Answer:", "one two one two one two one two"]
    params = [
        SamplingParams(structured_outputs=so, temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40),
    ]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert re.fullmatch(r"(ab|cd){2,6}x", got[0].outputs[0].text)
    drafter = spec.core.scheduler.drafter
    assert drafter is not None and drafter.stats.num_drafts > 0  # the neighbour was speculated
    assert_idle(spec)
