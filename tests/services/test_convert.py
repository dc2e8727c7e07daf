"""Fast checks of the typed <-> Protobuf conversions and the config helpers (no processes, no model)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from engine_core.core.request import FinishReason
from engine_core.core.seq_output import SeqOutput, TokenLogprobs, tensor_rows
from engine_core.plan import (
    CachedSequenceData,
    GrammarRequest,
    LogprobsTensors,
    ModelRunnerOutput,
    NewSequenceData,
    PromptLogprobs,
    SchedulerOutput,
)
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output.params import StructuredOutputsParams
from services.common.flags import add_flag, env_name
from services.common.trace import TraceContext
from services.convert.outputs import seq_output_from_proto, seq_output_to_proto
from services.convert.params import params_from_proto, params_to_proto
from services.convert.plan import plan_from_proto, plan_to_proto, result_from_proto, result_to_proto
from services.rpc import common_pb2

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_sampling_params_round_trip_keeps_every_field() -> None:
    params = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
        presence_penalty=-0.5, logit_bias={3: -2.5}, seed=11, max_tokens=None, min_tokens=2, stop=["\n"],
        stop_token_ids=[7], ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False,
        logprobs=3, prompt_logprobs=1, bad_words=["foo bar"], allowed_token_ids=[3, 4, 9],
    )  # fmt: skip
    params.eos_token_id = 2
    params.bad_words_token_ids = [[5, 6], [7]]
    back = params_from_proto(params_to_proto(params), internal=True)
    assert back == params and back.eos_token_id == 2 and back.bad_words_token_ids == [[5, 6], [7]]
    # the internal hops carry bad words as token ids only
    hop = params_from_proto(params_to_proto(params, with_stop_strings=False), internal=True)
    assert hop.bad_words is None and hop.bad_words_token_ids == [[5, 6], [7]]


def test_public_options_cannot_set_eos_and_keep_defaults() -> None:
    opts = common_pb2.SamplingOptions(eos_token_id=9, bad_words_token_ids=[common_pb2.TokenIdSequence(token_ids=[1])])
    back = params_from_proto(opts)
    assert back == SamplingParams() and back.eos_token_id is None and back.bad_words_token_ids is None
    with pytest.raises(ValueError, match=r"^temperature"):
        params_from_proto(common_pb2.SamplingOptions(temperature=-1))


def test_plan_and_result_round_trip() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    plan = SchedulerOutput(
        new_seqs=[NewSequenceData(3, [1, 2, 3], 3, params, None, [0, 1], 0, "r", TRACEPARENT, "k=v")],
        cached_seqs=[CachedSequenceData(1, [5], 17)],
        num_scheduled_tokens={3: 3, 1: 3},
        total_num_scheduled_tokens=6,
        finished_seq_ids=[0],
        copy_blocks=[(2, 6)],
        scheduled_spec_decode_tokens={1: [7, 8]},  # drafts are verified in one forward (speculative decoding)
        grammars=[GrammarRequest("g", StructuredOutputsParams(json='{"type": "object"}'))],  # compiled off-step
    )
    msg = plan_to_proto(plan, epoch="e", step=4)
    assert msg.new_seqs[0].trace.traceparent == TRACEPARENT and msg.new_seqs[0].request_id == "r"
    assert plan_from_proto(msg) == plan
    lps = LogprobsTensors(torch.tensor([[4, 4, 9]]), torch.tensor([[-0.1, -0.1, -2.0]]), torch.tensor([1]))
    plp = PromptLogprobs(
        1, LogprobsTensors(torch.tensor([[2], [3]]), torch.tensor([[-1.0], [-2.0]]), torch.tensor([3, 1]))
    )
    out = ModelRunnerOutput(
        [3, 8], [4, -1], lps, {3: plp}, errors={8: "sampling failed: boom"}, draft_token_ids={3: [5, 6, 7]}
    )
    out.grammar_results = {"g": "", "h": "structured_outputs.regex is invalid: x"}
    back = result_from_proto(result_to_proto(out))
    assert back.grammar_results == out.grammar_results
    assert back.seq_ids == [3, 8] and back.sampled_token_ids == [4, -1] and back.errors == {8: "sampling failed: boom"}
    assert back.draft_token_ids == {3: [5, 6, 7]}  # the worker's draft-model proposals
    # The scheduler decodes to numpy (it loads no torch): what its one reader, tensor_rows, takes out is the same.
    assert back.logprobs is not None and tensor_rows(back.logprobs, [0], 2) == tensor_rows(lps, [0], 2)
    assert tensor_rows(back.prompt_logprobs[3].tensors, slice(None), 0) == tensor_rows(plp.tensors, slice(None), 0)
    assert back.prompt_logprobs[3].start == 1


def test_seq_output_round_trip() -> None:
    out = SeqOutput("r", 1, [5], [TokenLogprobs([5, 6], [-0.5, -1.5], 1)], None, 0, FinishReason.STOP_STRING, "\n", 16)
    assert seq_output_from_proto("r", seq_output_to_proto(out)) == out  # float32-exact values
    out = SeqOutput("r", 0, [2], finish_reason=FinishReason.STOP_TOKEN, stop_reason=7)
    assert seq_output_from_proto("r", seq_output_to_proto(out)) == out
    out = SeqOutput("r", 0, [2, 3, 4], finish_reason=FinishReason.LENGTH, num_draft_tokens=12, num_accepted_tokens=7)
    assert seq_output_from_proto("r", seq_output_to_proto(out)) == out


def test_trace_context_from_metadata() -> None:
    ctx = TraceContext.from_metadata([("traceparent", TRACEPARENT), ("tracestate", "k=v"), ("other", "x")])
    assert ctx.as_dict() == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert TraceContext.from_metadata([("traceparent", "garbage")]).as_dict() == {}


def test_flags_fall_back_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name("--scheduler-addr") == "PAGODA_SCHEDULER_ADDR"
    monkeypatch.setenv("PAGODA_SCHEDULER_ADDR", "sched:1")
    monkeypatch.setenv("PAGODA_ENABLE_X", "false")
    p = argparse.ArgumentParser()
    add_flag(p, "--scheduler-addr", default="localhost:50052", help="")
    add_flag(p, "--enable-x", default=True, type=bool, help="")
    assert p.parse_args([]).scheduler_addr == "sched:1" and p.parse_args([]).enable_x is False
    assert p.parse_args(["--scheduler-addr", "other:2"]).scheduler_addr == "other:2"


def test_engine_flags_come_from_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_core.config import EngineConfig
    from services.scheduler.config import parse_scheduler_args
    from services.worker.config import parse_worker_args

    worker = parse_worker_args([]).engine
    assert worker == EngineConfig()  # every default is EngineConfig's own
    monkeypatch.setenv("PAGODA_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGODA_ENABLE_PREFIX_CACHING", "0")
    sched = parse_scheduler_args(["--max-num-batched-tokens", "64", "--num-kv-blocks", "none"])
    assert (sched.max_num_seqs, sched.enable_prefix_caching, sched.max_num_batched_tokens) == (7, False, 64)
    assert parse_worker_args(["--max-model-len", "32", "--attention-backend", "torch"]).engine.max_model_len == 32
    with pytest.raises(SystemExit):
        parse_scheduler_args(["--scheduling-policy", "lifo"])


def test_pagoda_serve_passes_the_compile_deadline_to_the_scheduler() -> None:
    from engine_core.config import EngineConfig
    from services.cli import _parser, scheduler_args
    from services.scheduler.config import parse_scheduler_args

    default = EngineConfig().structured_outputs_compile_timeout
    assert parse_scheduler_args([]).engine_config(16, 512, 8).structured_outputs_compile_timeout == default
    args = _parser().parse_args(["serve", "--structured-outputs-compile-timeout", "2.5"])
    sched = parse_scheduler_args(scheduler_args(args))
    assert sched.engine_config(16, 512, 8).structured_outputs_compile_timeout == 2.5
    for bad in ("0", "-3", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["serve", "--structured-outputs-compile-timeout", bad])
        with pytest.raises(SystemExit):
            parse_scheduler_args(["--structured-outputs-compile-timeout", bad])


def test_one_cache_dir_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from engine_core.config import default_cache_dir
    from kernels import cpu as cpu_kernels

    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    assert cpu_kernels._build_dir().parent.parent == Path(default_cache_dir())
    monkeypatch.delenv("PAGODA_CACHE")
    assert cpu_kernels._build_dir().parent.parent == Path(default_cache_dir())


def test_beam_search_options_round_trip_and_default_to_greedy() -> None:
    params = SamplingParams(
        n=2, use_beam_search=True, beam_width=4, temperature=0.0, length_penalty=0.5, early_stopping="never"
    )
    assert params_from_proto(params_to_proto(params), internal=True) == params
    opts = common_pb2.SamplingOptions(n=2, use_beam_search=True, early_stopping="true")
    back = params_from_proto(opts)  # an unset temperature means greedy with beam search
    assert back.temperature == 0.0 and back.early_stopping is True and back.beam_width is None
    with pytest.raises(ValueError, match=r"^early_stopping must be True, False or 'never'"):
        params_from_proto(common_pb2.SamplingOptions(use_beam_search=True, early_stopping="sometimes"))
    with pytest.raises(ValueError, match=r"^temperature must be 0 with beam search"):
        params_from_proto(common_pb2.SamplingOptions(use_beam_search=True, temperature=0.8))
