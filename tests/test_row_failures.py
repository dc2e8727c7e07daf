"""A step's failure pinned to one row fails that request alone (issue 35, item 2), on a real engine (the tiny random
Llama of tests/conftest.py): the failing request ends with an ERROR finish and a message, its blocks are freed, and
every neighbour finishes with exactly the tokens it gets when it runs alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.core.request import FinishReason, Request
from engine_core.core.seq_output import SeqOutput
from engine_core.engine import EngineCore
from engine_core.sample.logits_processor import BatchUpdate, BoundProcessor, LogitsProcessor
from engine_core.sampling_params import SamplingParams
from engine_core.worker.model_runner import ModelRunner

BLOCKS = 48
MARK = 99  # the failing request's prompt starts with this token


def make_core(tiny_dir: Path) -> tuple[EngineCore, ModelRunner]:
    config = EngineConfig(
        model=str(tiny_dir), block_size=4, num_kv_blocks=BLOCKS, max_num_seqs=6, attention_backend="cpu"
    )
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(BLOCKS)
    return EngineCore(config, runner, max_model_len=64, num_blocks=BLOCKS), runner


def neighbours() -> list[Request]:
    return [
        Request("greedy", [3, 9, 27, 81], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
        Request("seeded", [5, 7, 11], SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)),
        Request(
            "penalised",
            [1, 2, 3, 2, 1],
            SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.7, logprobs=2, ignore_eos=True),
        ),
    ]


def run(core: EngineCore, requests: Sequence[Request]) -> dict[str, list[SeqOutput]]:
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list[SeqOutput]] = {r.request_id: [] for r in requests}
    while core.has_unfinished:
        for out in core.step():
            outputs[out.request_id].append(out)
    return outputs


def tokens(outputs: list[SeqOutput]) -> dict[int, list[int]]:
    by_choice: dict[int, list[int]] = {}
    for out in outputs:
        by_choice.setdefault(out.index, []).extend(out.new_token_ids)
    return by_choice


def finish(outputs: list[SeqOutput]) -> dict[int, FinishReason | None]:
    return {out.index: out.finish_reason for out in outputs if out.finish_reason is not None}


@pytest.fixture(scope="module")
def alone(tiny_dir: Path) -> dict[str, dict[int, list[int]]]:
    core, _ = make_core(tiny_dir)
    return {rid: tokens(outs) for rid, outs in run(core, neighbours()).items()}


def assert_neighbours_unaffected(outputs: dict[str, list[SeqOutput]], alone: dict[str, dict[int, list[int]]]) -> None:
    for rid, expected in alone.items():
        assert tokens(outputs[rid]) == expected, rid
        assert finish(outputs[rid]) == {0: FinishReason.LENGTH}, rid


def test_a_request_with_nothing_left_to_sample_fails_alone(tiny_dir: Path, alone: dict) -> None:
    core, runner = make_core(tiny_dir)
    # allowed_token_ids and a bad word "5 5": after the first 5 no token is left, the row's logits all -inf
    bad = SamplingParams(max_tokens=5, allowed_token_ids=[5], bad_words_token_ids=[[5, 5]], n=2)
    bad.validate_vocab(128)  # not refusable up front: the first token is fine
    outputs = run(core, [*neighbours(), Request("masked", [MARK, 4, 4], bad)])
    assert_neighbours_unaffected(outputs, alone)
    assert finish(outputs["masked"]) == {0: FinishReason.ERROR, 1: FinishReason.ERROR}
    assert any("no token can be sampled" in out.error for out in outputs["masked"])
    assert tokens(outputs["masked"]) == {0: [5], 1: [5]}
    assert core.stats().free_blocks == BLOCKS  # every block back
    assert core.step() == [] and len(runner.sampling) == 0  # and the worker told to forget the rows


class FailingProcessor(LogitsProcessor):
    """A logits processor that raises on one request's rows (prompts starting with MARK), as a buggy grammar
    would: in `bind` (building the step's metadata) or in `apply` (sampling)."""

    def __init__(self, vocab_size: int, device: torch.device, max_rows: int, where: str) -> None:
        super().__init__(vocab_size, device, max_rows)
        self.where = where
        self.marked: set[int] = set()

    def update_state(self, update: BatchUpdate) -> None:
        self.marked.difference_update(update.removed)
        self.marked.update(r.slot for r in update.added if list(r.prompt_token_ids[:1]) == [MARK])

    def bind(self, slots: Sequence[int]) -> BoundProcessor | None:
        if not self.marked.intersection(slots):
            return None
        if self.where == "bind":
            raise RuntimeError("grammar state is corrupt")
        return RaisingApply()

    def is_argmax_invariant(self) -> bool:
        return False


class RaisingApply(BoundProcessor):
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("grammar state is corrupt")


@pytest.mark.parametrize("where", ["bind", "apply"])
def test_a_raising_logits_processor_fails_its_request_alone(tiny_dir: Path, alone: dict, where: str) -> None:
    core, runner = make_core(tiny_dir)
    runner.sampling.processors.append(FailingProcessor(runner.info.vocab_size, runner.device, 6, where))
    failing = Request("failing", [MARK, 8, 8, 8], SamplingParams(temperature=0.0, max_tokens=6))
    outputs = run(core, [*neighbours(), failing])
    assert_neighbours_unaffected(outputs, alone)
    assert finish(outputs["failing"]) == {0: FinishReason.ERROR}
    error = next(out.error for out in outputs["failing"] if out.error)
    assert error == "sampling failed: RuntimeError: grammar state is corrupt"
    assert core.stats().free_blocks == BLOCKS
