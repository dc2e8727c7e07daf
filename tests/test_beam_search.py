"""Beam search in the engine equals transformers' `generate(num_beams=k, do_sample=False)` token for token (a tiny
random Llama, float32), and its beams share KV blocks: forks copy only the partial block, pruned beams free theirs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_core.beam_search import BeamSearchParams, beam_request
from engine_core.config import EngineConfig
from engine_core.core.seq_output import SeqOutput
from engine_core.engine import EngineCore
from engine_core.worker.model_runner import ModelRunner

BLOCKS = 256
MAX_MODEL_LEN = 64
PROMPTS = [[3, 9, 27, 81], [5, 7, 11, 13, 17, 19, 23], [100, 4, 4, 4, 4, 4, 4, 4, 4, 60]]


def make_core(tiny_dir: Path, blocks: int = BLOCKS, max_num_seqs: int = 16) -> EngineCore:
    config = EngineConfig(
        model=str(tiny_dir), block_size=4, num_kv_blocks=blocks, max_num_seqs=max_num_seqs, attention_backend="cpu"
    )
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(blocks)
    return EngineCore(config, runner, max_model_len=MAX_MODEL_LEN, num_blocks=blocks)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def engine_beams(
    core: EngineCore, prompts: list[list[int]], params: BeamSearchParams, eos: int | None
) -> list[list[list[int]]]:
    """Every prompt's returned hypotheses (generated tokens), best first; all prompts run in one batch."""
    for i, prompt in enumerate(prompts):
        request, group = beam_request(str(i), prompt, params, eos, 128, MAX_MODEL_LEN)
        core.add_request(request, group)
    outputs: list[SeqOutput] = []
    while core.has_unfinished:
        outputs += core.step()
    result: list[list[list[int]]] = [[] for _ in prompts]
    for out in sorted(outputs, key=lambda o: (int(o.request_id), o.index)):
        assert not out.error
        result[int(out.request_id)].append(out.new_token_ids)
    return result


def hf_beams(
    model: torch.nn.Module, prompt: list[int], params: BeamSearchParams, eos: list[int] | None
) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=params.beam_width,
            num_return_sequences=params.num_returned,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
        )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        # NOTE: a hypothesis ends at its first stop token (no running beam continues past one); the rest is padding.
        ends = [i for i, t in enumerate(row) if t in (eos or [])]
        beams.append(row[: ends[0] + 1] if ends else row)
    return beams


# NOTE: 36 and 82 are tokens these prompts' beams reach within the budget, so hypotheses end on a stop token (and
# on the length limit); two stop tokens make transformers keep 3 x width candidates a step, as the engine must.
STOPS = [36, 82]


@pytest.mark.parametrize(
    ("width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (4, 0.0, "never"), (8, 2.0, True), (4, -1.0, False), (8, 1.5, "never"), (2, 1.0, True)],
)
def test_beams_equal_transformers_with_eos(
    tiny_dir: Path, hf_model: torch.nn.Module, width: int, length_penalty: float, early_stopping: bool | str
) -> None:
    core = make_core(tiny_dir)
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=12,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        n=width // 2 + 1,
        stop_token_ids=STOPS[1:],
    )
    ours = engine_beams(core, PROMPTS, params, STOPS[0])
    stopped = 0
    for prompt, beams in zip(PROMPTS, ours, strict=True):
        assert beams == hf_beams(hf_model, prompt, params, STOPS)
        stopped += sum(b[-1] in STOPS for b in beams)
    assert stopped > 0, "no hypothesis ended on a stop token: the test lost its point"
    assert core.stats().free_blocks == BLOCKS


@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_equal_transformers_without_eos(tiny_dir: Path, hf_model: torch.nn.Module, width: int) -> None:
    core = make_core(tiny_dir)
    params = BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True)
    ours = engine_beams(core, PROMPTS, params, eos=46)
    for prompt, beams in zip(PROMPTS, ours, strict=True):
        assert beams == hf_beams(hf_model, prompt, params, None)
        assert all(len(b) == 10 for b in beams)
