"""Greedy decoding through Pagoda equals transformers token for token (float32, real SmolLM2 weights).

The reference is transformers' own forward pass with its KV cache, one prompt at a time, argmax per step.
"""

from __future__ import annotations

import pytest
import torch

from engine_core import LLM, SamplingParams
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
SYSTEM = (
    "You are a meticulous assistant for a railway company. Answer questions about timetables, tickets and "
    "station facilities precisely, and say so when you do not know. "
)
PROMPTS = [
    "The capital of France is",
    "The capital of France is Paris, and the capital of Germany is",  # the first prompt is a prefix of this one
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning",
    "The three primary colours are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Here is a short poem about the sea:\n",
    "import numpy as np\n\narr = np.arange(10)\n",
    SYSTEM + "Which platform does the 9:15 to Lyon leave from?",
    SYSTEM + "Can I bring a bicycle on the train?",
    "A long prompt that spans more than three blocks of sixteen tokens: "
    + "the quick brown fox jumps over the lazy dog, " * 6,
    "Hi",
    "Explain photosynthesis in one sentence.",
    "List the planets of the solar system in order from the sun:",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model: torch.nn.Module) -> torch.nn.Module:
    return smollm2_hf_model


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    ids = [list(smollm2_tokenizer.encode(p)) for p in PROMPTS]
    assert ids[1][: len(ids[0])] == ids[0], "prompt 0 must be a token prefix of prompt 1"
    assert max(len(i) for i in ids) > 3 * 16
    return ids


@pytest.fixture(scope="module")
def reference(hf_model: torch.nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


def run(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (
            f"prompt {i} ({PROMPTS[i][:30]!r}) diverges at token {next(j for j in range(len(w)) if g[j] != w[j])}"
        )


def test_all_at_once(smollm2_dir: str, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
    llm = LLM(smollm2_dir, kv_cache_memory=0.5, enable_prefix_caching=False)
    assert_same(run(llm, prompt_ids), reference)


def test_chunked_prefill(smollm2_dir: str, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
    llm = LLM(smollm2_dir, kv_cache_memory=0.5, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert_same(run(llm, prompt_ids), reference)


def test_preemption(smollm2_dir: str, prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
    # 14 blocks of 16 tokens hold only a few sequences of up to ~100 tokens at once.
    llm = LLM(smollm2_dir, num_kv_blocks=14, max_num_batched_tokens=128)
    assert_same(run(llm, prompt_ids), reference)
    stats = llm.core.stats()
    assert stats.preemptions > 0
    assert stats.free_blocks == stats.total_blocks == 14


def test_prefix_cache_hits(
    offline_llm: LLM, hf_model: torch.nn.Module, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    # NOTE: the session engine, whose cache may already hold some of these prompts: the first round's output is
    # checked anyway, and a cold run's is test_all_at_once's.
    llm = offline_llm
    first = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    assert_same([o.outputs[0].token_ids for o in first], reference)
    # Second round: every prompt hits its own full blocks, short of the last token (which must be computed).
    second = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    assert_same([o.outputs[0].token_ids for o in second], reference)
    for ids, out in zip(prompt_ids, second, strict=True):
        assert out.num_cached_tokens == (len(ids) - 1) // 16 * 16
    # A new question behind the same system prompt reuses the system prompt's blocks.
    tok = llm.get_tokenizer()
    ids = list(tok.encode(SYSTEM + "Is there a waiting room at the station?"))
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 16 * (len(tok.encode(SYSTEM)) // 16 - 1) > 0
    assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, MAX_TOKENS)


def test_logprobs_match_transformers(offline_llm: LLM, hf_model: torch.nn.Module, prompt_ids: list[list[int]]) -> None:
    llm = offline_llm
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    prompts = prompt_ids[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        full = ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(input_ids=torch.tensor([full])).logits[0].float(), dim=-1)
        for j, (tok, pos) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs or [], strict=True)):
            row = ref[len(ids) - 1 + j]
            assert abs(pos[tok].logprob - float(row[tok])) < 1e-4
            assert pos[tok].rank == 1  # greedy picks the most likely token
            top = torch.topk(row, 5)
            for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(pos[t].logprob - lp) < 1e-4
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        for p in range(1, len(ids)):
            assert abs(out.prompt_logprobs[p][ids[p]].logprob - float(ref[p - 1, ids[p]])) < 1e-4


SPEC_METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 32},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "disable_by_batch_size": 32},
    # vLLM's suffix default, k = the tree depth (24): drafts up to 12, verification rows up to 13 (one 16-row block of
    # the coded kernel)
    "suffix_default": {"method": "suffix", "disable_by_batch_size": 32},
}


# NOTE: each method once, and each token budget once: the budget only bounds the drafts' room (Scheduler, via
# Drafter.propose's `room`), the same code for every method, so method x budget adds no path; suffix_default is
# vLLM's suffix defaults (drafts up to 12 tokens: 13-row verification steps).
@pytest.mark.parametrize(
    ("method", "max_num_batched_tokens"), [("ngram", 24), ("suffix", 2048), ("suffix_default", 2048)]
)
def test_speculative_decoding(
    smollm2_dir: str, prompt_ids: list[list[int]], reference: list[list[int]], method: str, max_num_batched_tokens: int
) -> None:
    """Drafts (n-gram lookup; suffix decoding) verified several per step (every prompt's rows in one batch, then
    chunked prefill): the output is transformers' token for token, and drafts were accepted (prompts like
    "1, 2, 3, 4, 5," repeat themselves)."""
    spec = SPEC_METHODS[method]
    llm = LLM(smollm2_dir, kv_cache_memory=0.5, speculative_config=spec, max_num_batched_tokens=max_num_batched_tokens)
    assert_same(run(llm, prompt_ids), reference)
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.free_blocks == stats.total_blocks


def test_speculative_decoding_with_a_draft_model(
    smollm2_dir: str, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    """The draft_model method with the target as its own draft, chunked prefill (the draft catches up a prompt over
    several proposals): the output is transformers' token for token, and (nearly) every draft is accepted."""
    spec = {"method": "draft_model", "model": smollm2_dir, "num_speculative_tokens": 3, "disable_by_batch_size": 32}
    llm = LLM(smollm2_dir, kv_cache_memory=0.5, speculative_config=spec, max_num_batched_tokens=24)
    assert_same(run(llm, prompt_ids), reference)
    stats = llm.core.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens >= 0.9 * stats.spec_decode_num_draft_tokens
    assert stats.free_blocks == stats.total_blocks
