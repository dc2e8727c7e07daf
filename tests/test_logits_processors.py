"""The logits-processor seam (allowed_token_ids, bad_words, and the built-ins' cost when unused), the sampler's
robustness to extreme-but-valid parameters and non-finite logits (a row fails alone, never the step)."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine_core.io.bad_words import bad_words_token_ids
from engine_core.sample.bad_words import banned_tokens
from engine_core.sample.sampler import FAILED_TOKEN, Sampler, SamplerOutput, apply_top_p
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.sampling_params import SamplingParams

SAMPLER = Sampler()


def step(batch: SamplingBatch, seq_ids: list[int], logits: torch.Tensor) -> SamplerOutput:
    out = SAMPLER(logits, batch.metadata(seq_ids))
    batch.append_tokens(seq_ids, out.sampled_token_ids)
    return out


def batch_of(vocab: int, params: list[SamplingParams], outputs: list[list[int]] | None = None) -> SamplingBatch:
    batch = SamplingBatch(vocab, "cpu", len(params) + 1, seed=0)
    for i, p in enumerate(params):
        batch.add(i, p, None, [], [] if outputs is None else outputs[i])
    return batch


# ---- the seam ------------------------------------------------------------------------------------------------------
def test_unused_processors_bind_nothing() -> None:
    batch = batch_of(20, [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)])
    meta = batch.metadata([0, 1])
    assert meta.processors == [] and meta.argmax_processors == []
    batch.add(2, SamplingParams(allowed_token_ids=[3]), None, [], [])
    assert batch.metadata([0, 1]).processors == []  # a processor only binds to the rows that use it
    assert len(batch.metadata([0, 1, 2]).processors) == 1


def test_allowed_token_ids_restrict_greedy_and_random_rows() -> None:
    vocab = 30
    logits = torch.randn(40, vocab)
    logits[:, 0] = 50.0  # the argmax, not allowed
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[4, 9])] * 20
    params += [SamplingParams(temperature=1.5, allowed_token_ids=[1, 2, 3])] * 19 + [SamplingParams(temperature=0.0)]
    out = step(batch_of(vocab, params), list(range(40)), logits).sampled_token_ids.tolist()
    greedy_pick = 4 if logits[0, 4] >= logits[0, 9] else 9
    assert out[0] == greedy_pick and all(t in (4, 9) for t in out[:20])
    assert all(t in (1, 2, 3) for t in out[20:39])
    assert out[39] == 0  # the unrestricted neighbour still gets its argmax


def test_bad_words_ban_a_words_last_token_only_after_its_prefix() -> None:
    vocab = 10
    assert banned_tokens([[7], [3, 4, 5]], []) == [7]
    assert banned_tokens([[7], [3, 4, 5]], [1, 3, 4]) == [7, 5]
    assert banned_tokens([[3, 4, 5]], [3, 4, 9]) == []
    # A greedy row that would say 3 4 5: it says 3 4 and then its second choice.
    logits = torch.zeros(1, vocab)
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[3, 4, 5]])
    batch = batch_of(vocab, [params])
    order = [3, 4, 5]
    got = []
    for t in range(3):
        logits = torch.zeros(1, vocab)
        logits[0, order[t]] = 10.0
        logits[0, 8] = 5.0
        got.append(int(step(batch, [0], logits).sampled_token_ids[0]))
    assert got == [3, 4, 8]
    # resumed after preemption with its outputs so far: the match continues across the resume
    batch = batch_of(vocab, [params], outputs=[[3, 4]])
    assert int(step(batch, [0], logits).sampled_token_ids[0]) == 8


def test_bad_words_are_tokenized_with_and_without_a_leading_space(smollm2_tokenizer: object) -> None:
    def encode(text: str) -> list[int]:
        return smollm2_tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]

    seqs = bad_words_token_ids(encode, ["hello", " world"])
    assert seqs == [encode("hello"), encode(" hello"), encode("world"), encode(" world")]
    assert encode("hello") != encode(" hello")


def test_an_all_greedy_step_skips_argmax_invariant_processors() -> None:
    batch = batch_of(8, [SamplingParams(temperature=0.0, logit_bias={2: 5.0})])
    meta = batch.metadata([0])
    assert len(meta.argmax_processors) == len(meta.processors) == 1  # logit_bias can change the argmax
    assert all(not p.is_argmax_invariant() for p in batch.processors)


# ---- failures stay in their row -------------------------------------------------------------------------------------
def test_a_row_with_every_token_masked_fails_alone() -> None:
    vocab = 12
    logits = torch.randn(3, vocab)
    params = [
        SamplingParams(temperature=0.0),
        # after an output of 5, a bad word "5 5" leaves nothing of allowed_token_ids [5]
        SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5, 5]]),
        SamplingParams(temperature=0.0, allowed_token_ids=[5], bad_words_token_ids=[[5, 5]]),
    ]
    out = step(batch_of(vocab, params, outputs=[[], [5], [5]]), [0, 1, 2], logits).sampled_token_ids.tolist()
    assert out == [int(logits[0].argmax()), FAILED_TOKEN, FAILED_TOKEN]


def test_non_finite_logits_fail_their_row_not_the_step() -> None:
    vocab = 300  # wider than the top-p candidates, so the fallback search runs too
    logits = torch.randn(4, vocab)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    params = [SamplingParams(top_p=0.3, top_k=5, min_p=0.1, seed=1)] * 3 + [SamplingParams(temperature=0.0)]
    out = SAMPLER(logits, batch_of(vocab, params).metadata([0, 1, 2, 3])).sampled_token_ids.tolist()
    assert out[1] == out[2] == FAILED_TOKEN
    assert 0 <= out[0] < vocab and out[3] == int(logits[3].argmax())
    # an all-random step (no greedy row maximum) catches them too
    out = SAMPLER(logits[:3], batch_of(vocab, params[:3]).metadata([0, 1, 2])).sampled_token_ids.tolist()
    assert out[1] == out[2] == FAILED_TOKEN and 0 <= out[0] < vocab
    # top-p over a NaN row keeps at least one candidate instead of indexing -1
    nan_row = torch.full((1, vocab), float("nan"))
    apply_top_p(nan_row, torch.tensor([0.5]))


# ---- extreme-but-valid parameters -----------------------------------------------------------------------------------
VOCAB = 48
HALF = VOCAB // 2  # allowed ids come from the lower half, bad words and stop ids from the upper: never all masked


def extreme(low: float, high: float, specials: list[float]) -> st.SearchStrategy[float]:
    values = [v for v in specials if low <= v <= high]
    return st.one_of(st.sampled_from(values), st.floats(low, high))


# float32 subnormals, the smallest float32 normal, and values that round to 0 in float32 (valid where 0 is)
SUBNORMALS = [1.4e-45, 1e-45, 1e-40, 1e-38, 1.1754944e-38, 1e-46, 1e-300, 5e-324]
HUGE = [1e30, 3.4e38, 3.4028235e38]


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    kwargs: dict[str, object] = {
        "temperature": draw(extreme(0.0, 3.4e38, [0.0, 1e-5, 1e-6, 1.0, *SUBNORMALS, *HUGE])),
        "top_p": draw(extreme(1.4e-45, 1.0, [1.0, 0.5, 1e-7, *SUBNORMALS])),
        "top_k": draw(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 10**6])),
        "min_p": draw(extreme(0.0, 1.0, [0.0, 1.0, *SUBNORMALS])),
        "repetition_penalty": draw(extreme(1.4e-45, 3.4e38, [1.0, 1e-4, 1e4, *SUBNORMALS, *HUGE])),
        "frequency_penalty": draw(extreme(-2.0, 2.0, [-2.0, 2.0, 0.0, *SUBNORMALS])),
        "presence_penalty": draw(extreme(-2.0, 2.0, [-2.0, 2.0, 0.0, *SUBNORMALS])),
        "seed": draw(st.none() | st.integers(0, 2**63 - 1)),
        "min_tokens": draw(st.integers(0, 3)),
        "eos_token_id": VOCAB - 1,
        "logprobs": draw(st.none() | st.integers(0, 5)),
    }
    bias = draw(st.dictionaries(st.integers(0, VOCAB - 1), extreme(-100.0, 100.0, [-100.0, 100.0, 0.0]), max_size=6))
    kwargs["logit_bias"] = bias or None
    kwargs["stop_token_ids"] = draw(st.lists(st.integers(HALF, VOCAB - 1), max_size=3)) or None
    kwargs["allowed_token_ids"] = draw(st.lists(st.integers(0, HALF - 1), min_size=1, max_size=8) | st.none())
    words = st.lists(st.integers(HALF, VOCAB - 1) | st.integers(0, VOCAB - 1), min_size=1, max_size=3)
    kwargs["bad_words_token_ids"] = draw(st.lists(words.map(lambda w: [*w[:-1], HALF + w[-1] % HALF]), max_size=3))
    kwargs["bad_words_token_ids"] = kwargs["bad_words_token_ids"] or None
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except ValueError:
        assume(False)
        raise


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    params=st.lists(sampling_params(), min_size=1, max_size=6),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB),
    steps=st.integers(1, 3),
    torch_seed=st.integers(0, 2**16),
)
def test_extreme_valid_parameters_always_sample_a_valid_token(
    params: list[SamplingParams], scale: float, prompt: list[int], steps: int, torch_seed: int
) -> None:
    torch.manual_seed(torch_seed)
    batch = SamplingBatch(VOCAB, "cpu", len(params), seed=torch_seed)
    for i, p in enumerate(params):
        batch.add(i, p, p.seed, prompt, [])
    seq_ids = list(range(len(params)))
    outputs: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        logits = torch.randn(len(params), VOCAB) * scale
        out = step(batch, seq_ids, logits)
        tokens = out.sampled_token_ids.tolist()
        for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
            assert 0 <= token < VOCAB, (p, token)
            if p.allowed_token_ids is not None:
                assert token in p.allowed_token_ids
            assert token not in banned_tokens(p.bad_words_token_ids or [], outputs[row])
            if len(outputs[row]) < p.min_tokens:
                assert token not in p.all_stop_token_ids
            outputs[row].append(token)
        if out.logprobs is not None:
            assert not torch.isnan(torch.as_tensor(out.logprobs.logprobs)).any()
            assert all(math.isfinite(v) or v == -math.inf for v in out.logprobs.logprobs[:, 0].tolist())
