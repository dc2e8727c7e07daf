"""`LLM.beam_search` equals transformers' `generate(num_beams=k, do_sample=False)` token for token (float32, real
SmolLM2 weights): k in 2, 4, 8, hypotheses that end on EOS and on the length limit, several length penalties and
early_stopping modes."""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, BeamSearchParams
from tests.hf_reference import hf_beams

pytestmark = pytest.mark.slow

PERIOD = 30  # "."
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",  # answers, then ends with EOS
    "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model: torch.nn.Module) -> torch.nn.Module:
    return smollm2_hf_model


@pytest.fixture(scope="module")
def llm(offline_llm: LLM) -> LLM:
    return offline_llm


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"), [(2, 1.0, False), (4, 0.5, True), (8, 1.0, "never")]
)
def test_beams_equal_transformers(
    llm: LLM, hf_model: torch.nn.Module, width: int, length_penalty: float, early_stopping: bool | str
) -> None:
    # NOTE: "." (token 30) as a stop token besides EOS: these prompts' beams reach it within 20 tokens (EOS alone they
    # do not), so hypotheses end on stop tokens as well as on the length limit.
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=20,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        n=2,
        stop_token_ids=[PERIOD],
    )
    tok = llm.get_tokenizer()
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    stops = [llm.engine.eos_token_id, PERIOD]
    ended_on_stop = 0
    for ids, out in zip(prompts, outs, strict=True):
        ours = [s.tokens[len(ids) :] for s in out.sequences]
        assert ours == hf_beams(hf_model, ids, params, stops), tok.decode(ids)
        ended_on_stop += sum(s.finish_reason == "stop" for s in out.sequences)
    assert ended_on_stop > 0
    assert llm.core.stats().free_blocks == llm.core.stats().total_blocks


def test_beams_equal_transformers_ignoring_eos(llm: LLM, hf_model: torch.nn.Module) -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    tok = llm.get_tokenizer()
    prompts = [list(tok.encode(p)) for p in PROMPTS[:2]]
    outs = llm.beam_search(PROMPTS[:2], params)
    for ids, out in zip(prompts, outs, strict=True):
        assert [s.tokens[len(ids) :] for s in out.sequences] == hf_beams(hf_model, ids, params, None)
