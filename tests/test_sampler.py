"""Sampler + SamplingBatch: exactness of greedy/penalties/bias/min_tokens/logprobs, statistics of random sampling,
and seeded determinism independent of batch composition."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine_core.sample.penalties import BoundPenalties, PenaltyState, apply_penalties
from engine_core.sample.sampler import (
    FAILED_TOKEN,
    TOP_P_CANDIDATES,
    Sampler,
    SamplerOutput,
    apply_top_p,
    compute_logprobs,
    row_argmax,
)
from engine_core.sample.sampling_batch import SamplingBatch, SamplingMetadata
from engine_core.sampling_params import SamplingParams

SAMPLER = Sampler()


def step(batch: SamplingBatch, seq_ids: list[int], logits: torch.Tensor) -> SamplerOutput:
    out = SAMPLER(logits, batch.metadata(seq_ids))
    batch.append_tokens(seq_ids, out.sampled_token_ids)
    return out


def penalty_state(meta: SamplingMetadata) -> PenaltyState:
    bound = [p for p in meta.processors if isinstance(p, BoundPenalties)]
    assert len(bound) == 1
    return bound[0].state


def batch_of(vocab: int, params: list[SamplingParams], seeds: list[int | None] | None = None) -> SamplingBatch:
    batch = SamplingBatch(vocab, "cpu", max(len(params), 1), seed=0)
    for i, p in enumerate(params):
        batch.add(i, p, None if seeds is None else seeds[i], [], [])
    return batch


# ---- greedy ------------------------------------------------------------------------------------------------------
def test_pure_greedy_is_argmax_with_ties() -> None:
    logits = torch.randn(6, 50)
    logits[:, 7] = logits[:, 30] = 10.0  # a tie for the max: argmax's first index must win
    logits[3] = 0.0
    batch = batch_of(50, [SamplingParams(temperature=0.0) for _ in range(6)])
    out = step(batch, list(range(6)), logits)
    assert torch.equal(out.sampled_token_ids, torch.argmax(logits, dim=-1))
    assert out.sampled_token_ids[0] == 7 and out.sampled_token_ids[3] == 0
    assert out.logprobs is None


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "strided"])
def test_row_argmax_is_torch_max_with_ties_and_non_finite_rows(view: bool) -> None:
    """The greedy pick (numpy's vectorised argmax on CPU) gives `max(dim=-1)`'s maxima and first maximal indices; a
    row with a NaN, +inf or nothing but -inf has a non-finite maximum, so greedy sampling fails that row alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 2 * 49_152 if view else 49_152, generator=gen)
    if view:
        logits = logits[:, 3 : 3 + 49_152]  # rows of a wider tensor
    logits[1, [5, 40_000]] = 50.0  # a tie: the first index
    logits[2, 17] = float("nan")
    logits[3, 9] = float("inf")
    logits[4] = float("-inf")
    logits[5] = 0.0
    values, index = row_argmax(logits)
    want_values, want_index = logits.max(dim=-1)
    finite = torch.isfinite(want_values)
    assert torch.equal(index[finite], want_index[finite]) and torch.equal(values[finite], want_values[finite])
    assert index.dtype == torch.int64 and index.tolist()[:2] == [want_index[0].item(), 5]
    assert torch.isnan(values[2]) and values[3] == float("inf") and values[4] == float("-inf")
    batch = batch_of(49_152, [SamplingParams(temperature=0.0) for _ in range(7)])
    tokens = step(batch, list(range(7)), logits).sampled_token_ids.tolist()
    assert tokens[2:5] == [FAILED_TOKEN] * 3 and tokens[:2] == want_index[:2].tolist() and tokens[5:] == [0, tokens[6]]


def test_top_k_1_equals_greedy_in_a_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    logits[:, 3] = logits[:, 20] = 5.0
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.5, min_p=0.2),
        SamplingParams(temperature=1.0),  # a random batch mate, so the greedy/random merge path runs
        SamplingParams(temperature=2.0, top_k=1, frequency_penalty=1.0),
    ]
    batch = batch_of(40, params, seeds=[None, 5, None, 6, None])
    penalised = []
    for _ in range(3):
        out = step(batch, list(range(5)), logits.clone()).sampled_token_ids
        assert out[0] == out[1] == out[2] == 3
        penalised.append(int(out[4]))
    # top_k=1 with a frequency penalty is greedy on the penalised logits: the tie flips as counts grow.
    assert penalised == [3, 20, 3]


def test_sampler_leaves_caller_logits_untouched() -> None:
    logits = torch.randn(3, 30)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.0, logit_bias={1: 5.0}),
        SamplingParams(repetition_penalty=1.5, top_k=4, min_tokens=2, eos_token_id=0),
    ]
    step(batch_of(30, params), [0, 1, 2], logits)
    assert torch.equal(logits, before)


# ---- seeded determinism --------------------------------------------------------------------------------------------
VOCAB = 64


def step_logits(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(VOCAB, generator=g) * 0.5 for _ in range(steps)]


TARGET = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.3)


def run_alone(seed: int, steps: int) -> list[int]:
    batch = SamplingBatch(VOCAB, "cpu", 4, seed=0)
    batch.add(10, TARGET, seed, [1, 2, 3], [])
    return [int(step(batch, [10], logits[None]).sampled_token_ids[0]) for logits in step_logits(steps)]


def test_seeded_row_independent_of_batch_mates() -> None:
    steps = 10
    alone = run_alone(1234, steps)
    batch = SamplingBatch(VOCAB, "cpu", 8, seed=7)
    batch.add(1, SamplingParams(temperature=1.0, top_k=5), 99, [4], [])
    batch.add(10, TARGET, 1234, [1, 2, 3], [])
    batch.add(2, SamplingParams(temperature=0.5, min_p=0.1), None, [], [])
    batch.add(3, SamplingParams(temperature=0.0, presence_penalty=1.0), None, [], [])
    mates = torch.randn(3, VOCAB)
    together = []
    for i, logits in enumerate(step_logits(steps)):
        # Batch membership and row order change between steps; only the target's logits are fixed.
        order = [[1, 10, 2, 3], [2, 3, 10], [10, 1]][i % 3]
        if i == 5:
            batch.add(4, SamplingParams(temperature=1.0), 4, [], [])
            order = [4, *order]
        rows = torch.stack([logits if s == 10 else mates[s % 3] for s in order])
        together.append(int(step(batch, order, rows).sampled_token_ids[order.index(10)]))
    assert together == alone
    assert run_alone(4321, steps) != alone  # the seed matters (so the comparison above can fail)


def test_seeded_row_resumes_identically_after_preemption() -> None:
    alone = run_alone(77, 8)
    batch = SamplingBatch(VOCAB, "cpu", 4, seed=0)
    batch.add(10, TARGET, 77, [1, 2, 3], [])
    got = []
    for i, logits in enumerate(step_logits(8)):
        if i == 4:  # preempted, then resumed with its outputs so far
            batch.remove(10)
            batch.add(10, TARGET, 77, [1, 2, 3], got)
        got.append(int(step(batch, [10], logits[None]).sampled_token_ids[0]))
    assert got == alone


def test_shared_generator_is_reproducible_from_the_batch_seed() -> None:
    logits = torch.zeros(16, 1000)

    def draw(seed: int) -> torch.Tensor:
        batch = SamplingBatch(1000, "cpu", 16, seed=seed)
        for i in range(16):
            batch.add(i, SamplingParams(), None, [], [])
        return step(batch, list(range(16)), logits).sampled_token_ids

    assert torch.equal(draw(3), draw(3))
    assert not torch.equal(draw(3), draw(4))


# ---- statistics of random sampling ---------------------------------------------------------------------------------
BASE = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
N = 20_000


def empirical(params: SamplingParams, logits: torch.Tensor = BASE) -> torch.Tensor:
    batch = SamplingBatch(len(logits), "cpu", N, seed=11)
    for i in range(N):
        batch.add(i, params, None, [], [])
    tokens = step(batch, list(range(N)), logits.expand(N, -1).clone()).sampled_token_ids
    return torch.bincount(tokens, minlength=len(logits)).double() / N


def assert_matches(freq: torch.Tensor, expected: torch.Tensor) -> None:
    expected = expected.double() / expected.sum()
    # 5 binomial standard deviations per token (floor of one count's worth for tiny probabilities).
    tol = 5 * torch.sqrt(torch.clamp(expected * (1 - expected), min=1 / N) / N)
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)
    assert torch.all(freq[expected == 0] == 0), "a token outside the allowed set was drawn"


def nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Reference top-p: the smallest set of most likely tokens whose mass reaches p."""
    if p >= 1.0:
        return probs
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for tok in order.tolist():
        keep[tok] = True
        mass += float(probs[tok])
        if mass >= p:
            break
    return torch.where(keep, probs, 0.0)


def top_k_ref(probs: torch.Tensor, k: int) -> torch.Tensor:
    keep = probs.argsort(descending=True)[:k]
    return torch.zeros_like(probs).index_copy_(0, keep, probs[keep])


def test_temperature_distribution() -> None:
    assert_matches(empirical(SamplingParams(temperature=0.7)), torch.softmax(BASE / 0.7, -1))
    assert_matches(empirical(SamplingParams(temperature=1.0)), torch.softmax(BASE, -1))


def test_top_p_distribution() -> None:
    probs = torch.softmax(BASE / 0.8, -1)
    expected = nucleus(probs, 0.75)
    assert (expected > 0).sum() == 3  # p is far from a boundary, so the reference is unambiguous
    assert_matches(empirical(SamplingParams(temperature=0.8, top_p=0.75)), expected)


def test_top_p_over_a_large_vocabulary_matches_the_sort_reference() -> None:
    # Peaked rows find their nucleus among the candidates; flat rows need the whole-vocabulary fallback.
    vocab = 4 * TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(8)
    logits = torch.cat([torch.randn(4, vocab, generator=g) * 6, torch.randn(4, vocab, generator=g) * 0.3])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.3, 0.9, 1.0, 0.75])
    got = apply_top_p(logits.clone(), top_p)
    for row in range(len(logits)):
        expected = nucleus(torch.softmax(logits[row].double(), -1), float(top_p[row])) > 0
        assert torch.equal(got[row] > float("-inf"), expected), row
    assert (got[5] > float("-inf")).sum() > TOP_P_CANDIDATES  # the fallback really ran


def test_min_p_distribution() -> None:
    probs = torch.softmax(BASE, -1)
    expected = torch.where(probs >= 0.2 * probs.max(), probs, 0.0)
    assert 0 < (expected == 0).sum() < len(BASE)
    assert_matches(empirical(SamplingParams(min_p=0.2)), expected)


def test_top_k_distribution() -> None:
    assert_matches(empirical(SamplingParams(temperature=1.5, top_k=3)), top_k_ref(torch.softmax(BASE / 1.5, -1), 3))


def test_top_k_then_top_p_distribution() -> None:
    probs = top_k_ref(torch.softmax(BASE, -1), 5)
    expected = nucleus(probs / probs.sum(), 0.6)
    assert_matches(empirical(SamplingParams(top_k=5, top_p=0.6)), expected)


def test_mixed_batch_rows_follow_their_own_parameters() -> None:
    # Greedy rows, two different top-k values and a row without top-k share one (top-k only) batch.
    groups = [
        (SamplingParams(temperature=0.0), torch.nn.functional.one_hot(torch.tensor(0), len(BASE)).double()),
        (SamplingParams(top_k=2), top_k_ref(torch.softmax(BASE, -1), 2)),
        (SamplingParams(temperature=0.7, top_k=5), top_k_ref(torch.softmax(BASE / 0.7, -1), 5)),
        (SamplingParams(temperature=1.0), torch.softmax(BASE, -1)),
    ]
    batch = SamplingBatch(len(BASE), "cpu", N, seed=5)
    for i in range(N):
        batch.add(i, groups[i % 4][0], None, [], [])
    tokens = step(batch, list(range(N)), BASE.expand(N, -1).clone()).sampled_token_ids
    n = N // 4
    for g, (_, probs) in enumerate(groups):
        freq = torch.bincount(tokens[g::4], minlength=len(BASE)).double() / n
        expected = probs / probs.sum()
        tol = 5 * torch.sqrt(torch.clamp(expected * (1 - expected), min=1 / n) / n)
        assert torch.all((freq - expected).abs() <= tol), (g, freq, expected)
        assert torch.all(freq[expected == 0] == 0)


# ---- penalties, logit bias, min_tokens -----------------------------------------------------------------------------
def reference_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    out = logits.clone()
    for tok in set(prompt) | set(output):
        r = params.repetition_penalty
        out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
    for tok, count in Counter(output).items():
        out[tok] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_penalties_match_a_per_row_reference() -> None:
    vocab = 32
    torch.manual_seed(3)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),  # no penalties: must be untouched
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    prompts = [[1, 2, 3, 3], [4], [5, 6], [7, 8, 9], []]
    outputs: list[list[int]] = [[], [], [10, 10], [2], []]  # resumed sequences bring their outputs
    batch = SamplingBatch(vocab, "cpu", 8)
    for i, p in enumerate(params):
        batch.add(i, p, None, prompts[i], outputs[i])
    seq_ids = [3, 0, 4, 1, 2]  # row order differs from slot order
    for _ in range(6):
        logits = torch.randn(len(seq_ids), vocab) * 3
        meta = batch.metadata(seq_ids)
        got = apply_penalties(logits.clone(), penalty_state(meta))
        for row, s in enumerate(seq_ids):
            expected = reference_penalties(logits[row], params[s], prompts[s], outputs[s])
            torch.testing.assert_close(got[row], expected, rtol=0, atol=1e-5)
        tokens = torch.randint(0, 12, (len(seq_ids),))  # small range: tokens repeat, counts grow above 1
        batch.append_tokens(seq_ids, tokens)
        for row, s in enumerate(seq_ids):
            outputs[s].append(int(tokens[row]))
        # and the sampler's greedy pick is the argmax of the penalised logits
        out = SAMPLER(logits, meta).sampled_token_ids
        assert torch.equal(out, got.argmax(-1))


def test_penalty_state_survives_growth_of_its_tensors() -> None:
    batch = SamplingBatch(16, "cpu", 8)
    batch.add(0, SamplingParams(temperature=0.0, frequency_penalty=1.0), None, [], [5, 5])
    batch.append_tokens([0], torch.tensor([6]))
    for s in range(1, 4):  # each add may reallocate the count tensors
        batch.add(s, SamplingParams(temperature=0.0, presence_penalty=1.0), None, [], [])
    got = apply_penalties(torch.zeros(1, 16), penalty_state(batch.metadata([0])))[0]
    assert got[5] == -2.0 and got[6] == -1.0 and got[7] == 0.0


def test_logit_bias() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={8: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={4: -100.0, 2: 0.5}),
        SamplingParams(temperature=0.0),
    ]
    out = step(batch_of(10, params), [0, 1, 2], logits).sampled_token_ids
    assert out.tolist() == [8, 2, 4]
    # a random row with a -100 bias on every token but one samples that one
    batch = batch_of(10, [SamplingParams(logit_bias={t: -100.0 for t in range(10) if t != 6})] * 50)
    assert torch.all(step(batch, list(range(50)), torch.zeros(50, 10)).sampled_token_ids == 6)


def test_min_tokens_masks_stop_tokens_then_releases_them() -> None:
    eos, stop, other = 2, 5, 7
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, other] = 9.0, 8.0, 1.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], eos_token_id=eos)
    batch = batch_of(10, [params])
    got = [int(step(batch, [0], logits).sampled_token_ids[0]) for _ in range(5)]
    assert got == [other, other, other, eos, eos]
    # resumed with two outputs: one more masked step
    batch = SamplingBatch(10, "cpu", 2)
    batch.add(0, params, None, [], [other, other])
    assert [int(step(batch, [0], logits).sampled_token_ids[0]) for _ in range(2)] == [other, eos]
    # ignore_eos: eos is not a stop token, so only the stop id is masked
    batch = batch_of(10, [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[eos], ignore_eos=True)])
    logits[0, eos] = 0.0
    assert int(step(batch, [0], logits).sampled_token_ids[0]) == stop


# ---- logprobs ------------------------------------------------------------------------------------------------------
def test_logprobs_are_of_raw_logits_with_correct_ranks() -> None:
    torch.manual_seed(4)
    vocab = 50
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(temperature=0.5, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=5, logit_bias={9: 50.0}),
        SamplingParams(temperature=1.2, top_p=0.9),  # asked for none: still gets a row
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    batch = SamplingBatch(vocab, "cpu", 4)
    for i, p in enumerate(params):
        batch.add(i, p, None, [1, 2, 3], [])
    out = SAMPLER(logits, batch.metadata([0, 1, 2, 3]))
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)
    reference = torch.log_softmax(logits.double(), -1)
    sampled = out.sampled_token_ids
    assert sampled[1] == 9  # sampled from the biased logits, but reported with raw logprobs
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(
        lp.logprobs[:, 0].double(), reference.gather(1, sampled[:, None])[:, 0], atol=1e-6, rtol=0
    )
    top = reference.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:].double(), top.values, atol=1e-6, rtol=0)
    for row in range(4):
        tok = int(sampled[row])
        expected_rank = 1 + int((reference[row] > reference[row, tok]).sum())
        assert int(lp.ranks[row]) == expected_rank
    assert int(lp.ranks[3]) == 1 and int(lp.ranks[1]) > 1


def test_compute_logprobs_k0_and_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    lp = compute_logprobs(logits, torch.tensor([2, 3]), 0)
    assert lp.token_ids.tolist() == [[2], [3]]
    assert lp.ranks.tolist() == [1, 1]  # ties with the best token are rank 1
    torch.testing.assert_close(lp.logprobs[1, 0], torch.tensor(math.log(0.25)))
    assert compute_logprobs(logits, torch.tensor([0, 0]), 2).ranks.tolist() == [3, 1]


# ---- metadata caching ----------------------------------------------------------------------------------------------
def test_metadata_is_cached_until_membership_or_order_changes() -> None:
    batch = SamplingBatch(10, "cpu", 4)
    for s in range(3):
        batch.add(s, SamplingParams(seed=None), None, [], [])
    meta = batch.metadata([0, 1, 2])
    assert batch.metadata([0, 1, 2]) is meta
    batch.add(3, SamplingParams(), None, [], [])  # a newcomer not sampled yet does not invalidate
    assert batch.metadata([0, 1, 2]) is meta
    batch.remove(3)
    assert batch.metadata([0, 1, 2]) is meta
    assert batch.metadata([2, 1, 0]) is not meta
    meta = batch.metadata([0, 1, 2])
    batch.remove(1)
    assert batch.metadata([0, 2]) is not meta
    batch.remove(42)  # unknown ids are ignored
    with pytest.raises(ValueError, match="already"):
        batch.add(0, SamplingParams(), None, [], [])
    with pytest.raises(ValueError, match="logit_bias"):
        batch.add(5, SamplingParams(logit_bias={10: 1.0}), None, [], [])
