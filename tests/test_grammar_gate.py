"""The compile gate of structured output (core/grammar_gate.py): a request whose grammar is new waits outside the
steps while the worker compiles it on its compile thread; its unconstrained neighbours' steps go on as if it were not
there; it is admitted once the worker reports the grammar ready (its matcher then a cache hit on the step thread);
a compile failure or a deadline ends it alone; an abort while it compiles releases everything."""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_core import LLM, SamplingParams, StructuredOutputsParams
from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput
from engine_core.sampling_params import with_eos
from engine_core.structured_output.backend import GrammarCompile
from engine_core.worker.model_runner import ModelRunner

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def llm(tiny_vocab_dir: Path) -> LLM:
    return LLM(str(tiny_vocab_dir), kv_cache_memory=0.05, max_model_len=512)


def runner(llm: LLM) -> ModelRunner:
    executor = llm.core.executor
    assert isinstance(executor, ModelRunner)
    return executor


def params(so: StructuredOutputsParams | None = None, max_tokens: int = 8) -> SamplingParams:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=so is None, structured_outputs=so)
    return with_eos(p, EOS, VOCAB)


def huge_choice(tag: str) -> StructuredOutputsParams:
    """1,024 long alternatives: a grammar whose compile is far slower than a schema's."""
    return StructuredOutputsParams(choice=[f"{tag}-{i:04d}-" + "xyz" * 17 for i in range(1024)])


@dataclass
class Run:
    steps: dict[str, list[int]] = field(default_factory=dict)  # request_id -> the steps that gave it tokens
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, SeqOutput] = field(default_factory=dict)


def run(llm: LLM, limit: int = 200) -> Run:
    """Steps the engine until idle, recording which step gave each request its tokens."""
    seen = Run()
    step = 0
    while llm.core.has_unfinished and step < limit:
        step += 1
        for out in llm.core.step():
            if out.new_token_ids:
                seen.steps.setdefault(out.request_id, []).append(step)
                seen.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                seen.finished[out.request_id] = out
    return seen


def assert_idle(llm: LLM) -> None:
    sched = llm.core.scheduler
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.requests and not sched.grammar_gate.held and not sched.waiting and not sched.running


def test_a_new_grammar_compiles_off_the_steps_and_is_admitted_when_ready(llm: LLM) -> None:
    events: list[tuple[GrammarCompile, str]] = []
    backend = runner(llm).grammar_backend
    assert backend is not None
    backend.on_compile = lambda e: events.append((e, threading.current_thread().name))
    ids = llm.tokenizer.encode("Answer:")
    so = huge_choice("gate")
    try:
        llm.core.add_request(Request("alone", ids, params()))
        alone = run(llm)
        llm.core.add_request(Request("plain", ids, params()))
        llm.core.add_request(Request("constrained", ids, params(so, max_tokens=64)))
        sched = llm.core.scheduler
        assert "constrained" in sched.grammar_gate.held and len(sched.waiting) == 1  # held outside the queue
        assert llm.core.stats().waiting == 2
        both = run(llm)
    finally:
        backend.on_compile = None
    # The unconstrained request's steps are those it has alone: the compile never ran in one of them.
    assert both.steps["plain"] == alone.steps["alone"]
    assert both.tokens["plain"] == alone.tokens["alone"]
    # The constrained one joined a later step (the gate's answer comes with a step's result) and was served.
    assert both.steps["constrained"][0] > 1
    assert both.finished["constrained"].finish_reason is FinishReason.STOP_TOKEN
    text = llm.tokenizer.decode(both.tokens["constrained"], skip_special_tokens=True)
    assert re.fullmatch(r"gate-\d{4}-(xyz){17}", text), text
    # Compiled once, on the compile thread; the step thread's matcher was a copy from the cache.
    compiled = [(e.cache_hit, thread) for e, thread in events if e.kind == "choice"]
    assert compiled[0][0] is False and compiled[0][1].startswith("grammar-compile")
    assert all(hit for hit, _ in compiled[1:]) and len(compiled) == 2
    # The same grammar again is known compiled: admitted at once, not held.
    llm.core.add_request(Request("again", ids, params(so, max_tokens=4)))
    assert not llm.core.scheduler.grammar_gate.held
    run(llm)
    assert_idle(llm)


def test_a_compile_failure_or_the_deadline_ends_only_that_request(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Answer:")
    # "(((" skips the frontend's check (`with_eos`; added to the core directly): the worker's compile fails
    bad = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="((("))
    bad.eos_token_id = EOS
    llm.core.add_request(Request("bad", ids, bad))
    llm.core.add_request(Request("good", ids, params()))
    seen = run(llm)
    assert seen.finished["bad"].finish_reason is FinishReason.ERROR
    assert "structured_outputs.regex is invalid" in seen.finished["bad"].error
    assert "bad" not in seen.steps  # never in a step
    assert seen.finished["good"].finish_reason is FinishReason.LENGTH and len(seen.tokens["good"]) == 8
    assert_idle(llm)

    gate = llm.core.scheduler.grammar_gate
    deadline_s, gate.deadline_s = gate.deadline_s, 0.0  # any compile outlasts it
    try:
        llm.core.add_request(Request("late", ids, params(huge_choice("late"))))
        llm.core.add_request(Request("on-time", ids, params()))
        seen = run(llm)
    finally:
        gate.deadline_s = deadline_s
    assert seen.finished["late"].finish_reason is FinishReason.ERROR
    assert seen.finished["late"].error == "structured_outputs.choice did not compile within 0 s"
    assert seen.finished["on-time"].finish_reason is FinishReason.LENGTH
    assert_idle(llm)


def test_the_compile_deadline_is_the_engines_structured_outputs_compile_timeout(tiny_vocab_dir: Path) -> None:
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="structured_outputs_compile_timeout"):
            EngineConfig(structured_outputs_compile_timeout=bad)
    llm = LLM(str(tiny_vocab_dir), kv_cache_memory=0.05, max_model_len=512, structured_outputs_compile_timeout=1e-6)
    ids = llm.tokenizer.encode("Answer:")
    llm.core.add_request(Request("late", ids, params(huge_choice("setting"))))
    llm.core.add_request(Request("on-time", ids, params()))
    seen = run(llm)
    assert seen.finished["late"].finish_reason is FinishReason.ERROR
    assert seen.finished["late"].error == "structured_outputs.choice did not compile within 1e-06 s"
    assert seen.finished["on-time"].finish_reason is FinishReason.LENGTH
    assert_idle(llm)


def hold_compile_thread(llm: LLM) -> threading.Event:
    """Occupies the worker's (one) compile thread until the event is set: the compiles asked meanwhile queue behind
    it, so a test sees them in flight whatever the machine's speed."""
    backend = runner(llm).grammar_backend
    assert backend is not None
    backend.prepare(StructuredOutputsParams(regex="warm")).result()  # the thread exists
    release, started = threading.Event(), threading.Event()

    def occupy() -> None:
        started.set()
        release.wait(60)

    assert backend._compiler is not None
    backend._compiler.submit(occupy)
    started.wait(10)
    return release


def test_abort_while_compiling_releases_everything(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Answer:")
    worker = runner(llm)
    release = hold_compile_thread(llm)
    try:
        llm.core.add_request(Request("gone", ids, params(huge_choice("abort"))))
        llm.core.add_request(Request("stays", ids, params()))
        llm.core.step()  # the compile is asked for; it waits behind the held thread
        assert "gone" in llm.core.scheduler.grammar_gate.held and worker.grammars
        (out,) = llm.core.abort("gone")
        assert out.finish_reason is FinishReason.ABORT
        assert not llm.core.scheduler.grammar_gate.held
    finally:
        release.set()
    seen = run(llm)
    assert "gone" not in seen.steps and seen.finished["stays"].finish_reason is FinishReason.LENGTH
    assert_idle(llm)
    # the worker's answer for the aborted request is read and dropped: nothing is pending there either
    for _ in range(100):
        if not worker.grammars:
            break
        llm.core.add_request(Request("poll", ids, params(max_tokens=1)))
        run(llm)
    assert not worker.grammars
    assert_idle(llm)
