"""OutputProcessor: SeqOutputs of the engine steps -> RequestOutputs (text, stop strings, logprobs), no model."""

from __future__ import annotations

from engine_core.core.request import FinishReason
from engine_core.core.seq_output import SeqOutput, TokenLogprobs
from engine_core.io.output_processor import OutputProcessor
from engine_core.sampling_params import SamplingParams


def test_text_streams_and_a_stop_string_ends_the_choice(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(" one two. three four")
    proc = OutputProcessor(tok)
    proc.add_request("r", "p", [1, 2], SamplingParams(n=2, stop=["."], max_tokens=50))
    texts = ["", ""]
    stops = []
    for t in ids:
        step = proc.process([SeqOutput("r", 0, [t]), SeqOutput("r", 1, [t])])
        stops += step.stops
        for upd in step.updates:
            for d in upd.deltas:
                texts[d.index] += d.text
        if step.updates and step.updates[0].output.finished:
            break
    # both choices stop at ".", which is not included; the engine is told once per choice
    assert texts == [" one two", " one two"]
    assert sorted((s.index, s.stop) for s in stops) == [(0, "."), (1, ".")]
    out = step.updates[0].output
    assert out.finished and [o.finish_reason for o in out.outputs] == ["stop", "stop"]
    assert [o.stop_reason for o in out.outputs] == [".", "."] and "r" not in proc.requests


def test_engine_finish_and_logprobs_reach_the_request_output(smollm2_tokenizer) -> None:
    proc = OutputProcessor(smollm2_tokenizer)
    proc.add_request("r", None, [5], SamplingParams(logprobs=1))
    lps = [TokenLogprobs([7, 9], [-0.5, -1.5], 1)]
    proc.process([SeqOutput("r", 0, [7], new_logprobs=lps, num_cached_tokens=16)])
    step = proc.process([SeqOutput("r", 0, [8], new_logprobs=[TokenLogprobs([8, 8], [-0.25, -0.25], 1)],
                                   finish_reason=FinishReason.LENGTH)])  # fmt: skip
    out = step.updates[0].output
    assert out.finished and out.num_cached_tokens == 16
    choice = out.outputs[0]
    assert choice.token_ids == [7, 8] and choice.finish_reason == "length"
    assert choice.cumulative_logprob == -0.75
    assert choice.logprobs is not None and set(choice.logprobs[0]) == {7, 9} and set(choice.logprobs[1]) == {8}
    assert choice.logprobs[0][9].rank == 1 and choice.logprobs[0][7].rank == 1


def test_a_streaming_caller_reads_logprobs_from_the_deltas_only(smollm2_tokenizer) -> None:
    proc = OutputProcessor(smollm2_tokenizer)
    proc.add_request("r", None, [5], SamplingParams(logprobs=1), keep_logprobs=False)
    first = proc.process([SeqOutput("r", 0, [7], new_logprobs=[TokenLogprobs([7, 9], [-0.5, -1.5], 1)])])
    assert first.updates[0].deltas[0].logprobs is not None and set(first.updates[0].deltas[0].logprobs[0]) == {7, 9}
    step = proc.process([SeqOutput("r", 0, [8], new_logprobs=[TokenLogprobs([8, 8], [-0.25, -0.25], 1)],
                                   finish_reason=FinishReason.LENGTH)])  # fmt: skip
    choice = step.updates[0].output.outputs[0]
    assert choice.logprobs is None and choice.cumulative_logprob == -0.75 and choice.token_ids == [7, 8]


def test_abort_finishes_every_open_choice(smollm2_tokenizer) -> None:
    proc = OutputProcessor(smollm2_tokenizer)
    proc.add_request("r", None, [5], SamplingParams(n=2))
    proc.process([SeqOutput("r", 1, [], finish_reason=FinishReason.LENGTH)])
    out = proc.abort("r")
    assert out is not None and out.finished
    assert [o.finish_reason for o in out.outputs] == ["abort", "length"]
    assert proc.abort("r") is None
