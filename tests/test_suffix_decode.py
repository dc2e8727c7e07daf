"""The `suffix` speculative method (engine_core/spec_decode/suffix_*.py): drafts come from the request's own tokens
and its tenant's cached outputs, by match frequency; the cache is bounded and evicts the oldest; a tenant never gets
another salt's continuation; greedy output is the same with and without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.sampling_params import SamplingParams
from engine_core.spec_decode import suffix_cache
from engine_core.spec_decode.stats import SpecDecodeStats
from engine_core.spec_decode.suffix_cache import SuffixCache
from tests.test_spec_decode import PROMPTS, accepted, assert_same, generate, make_core

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0}


def cache(depth: int = 24, cached: int = 100, factor: float = 4.0, min_prob: float = 0.0) -> SuffixCache:
    return SuffixCache(depth, cached, factor, min_prob)


def test_the_draft_continues_the_requests_own_earlier_occurrence() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert cache().propose(tokens, None, 3) == [4, 5, 6]
    assert cache().propose(tokens, None, 2) == [4, 5]  # at most k
    assert cache(factor=1.0).propose([7, 3, 4, 5, 7, 3], None, 4) == [4, 5]  # <= factor * match length (2)
    assert cache().propose([1, 2, 3], None, 4) == []  # the last token never occurred before


def test_match_and_draft_stay_within_the_tree_depth_when_k_exceeds_it() -> None:
    """vLLM's suffix default k is the tree depth: the draft is what depth and factor leave (12 of 24 at factor 1)."""
    span = list(range(100, 140))
    tokens = [*span, 7, *span[:30]]  # the prompt's 40-token span being copied, 30 tokens in
    # the log continues past the span (7, then the span again): 12 tokens
    assert cache(depth=24, factor=1.0).propose(tokens, None, 24) == [*span[30:40], 7, 100]
    long_span = list(range(100, 160))
    tokens = [*long_span, 7, *long_span[:30]]
    assert cache(depth=24, factor=1.0).propose(tokens, None, 24) == long_span[30:42]  # match 12, draft 12
    assert cache(depth=24, factor=1.0).propose(tokens, None, 8) == long_span[30:38]  # k below the bounds: k
    assert cache(depth=32, factor=1.0).propose(tokens, None, 32) == long_span[30:46]  # deeper tree, longer draft


def test_a_single_remaining_path_stops_at_its_documents_end() -> None:
    """One occurrence left (read in one slice): the draft never crosses into the next cached output."""
    c = cache()
    c.add_output([10, 11, 12, 13], None)
    c.add_output([20, 21, 22, 23, 24, 25], None)
    assert c.propose([3, 10, 11], None, 8) == [12, 13]
    assert c.propose([3, 21, 22], None, 8) == [23, 24, 25]
    assert c.propose([3, 21, 22], None, 2) == [23, 24]


def test_suffix_defaults_k_to_its_tree_depth_as_vllm() -> None:
    from engine_core.spec_decode.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig

    assert SpeculativeConfig(method="suffix").num_speculative_tokens == 24
    assert SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=32).num_speculative_tokens == 32
    assert SpeculativeConfig(method="suffix", num_speculative_tokens=5).num_speculative_tokens == 5
    assert SpeculativeConfig(method="ngram").num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS


def test_the_most_frequent_continuation_wins_and_min_prob_cuts_the_path() -> None:
    # after "5": 6 twice, 8 once -> 6 (probability 2/3); then after "5 6": 7 and 0 once each -> p = 1/3
    tokens = [5, 6, 7, 5, 8, 1, 5, 6, 0, 5]
    assert cache(min_prob=0.5).propose(tokens, None, 4) == [6]
    assert cache(min_prob=0.0).propose(tokens, None, 4)[:1] == [6]
    assert cache(min_prob=0.7).propose(tokens, None, 4) == []


def test_drafts_come_from_the_same_tenants_cached_outputs_only() -> None:
    c = cache()
    c.add_output([10, 11, 12, 13, 14, 15], "alice")
    c.add_output([10, 11, 12, 40, 41, 42], "bob")
    c.add_output([10, 11, 12, 50, 51, 52], None)
    assert c.propose([3, 10, 11, 12], "alice", 3) == [13, 14, 15]
    assert c.propose([3, 10, 11, 12], "bob", 3) == [40, 41, 42]
    assert c.propose([3, 10, 11, 12], None, 3) == [50, 51, 52]
    assert c.propose([3, 10, 11, 12], "carol", 3) == []  # a tenant with nothing cached gets nothing
    # nothing carol sees, in any context, comes from another tenant's outputs
    for context in ([10], [11, 12], [12, 13], [40], [50, 51]):
        assert c.propose([3, *context], "carol", 4) == []


def test_the_cache_keeps_at_most_max_cached_requests_and_evicts_the_oldest() -> None:
    c = cache(cached=3)
    for i in range(5):
        c.add_output([100 + i, 300 + i, 200 + i], "t")
    assert c.num_cached_requests == 3
    assert c.propose([1, 100, 300], "t", 1) == []  # evicted
    assert c.propose([1, 101, 301], "t", 1) == []  # evicted
    assert c.propose([1, 104, 304], "t", 1) == [204]
    for i in range(5, 40):  # compaction of the evicted prefix keeps the live outputs findable
        c.add_output([100 + i, 300 + i, 200 + i], "t")
    assert c.num_cached_requests == 3 and c.num_cached_tokens == 3 * 4
    assert c.propose([1, 139, 339], "t", 1) == [239]
    assert c.propose([1, 137, 337], "t", 1) == [237]
    assert c.propose([1, 136, 336], "t", 1) == []


def test_the_cache_is_bounded_in_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suffix_cache, "MAX_CACHED_TOKENS", 10)
    c = cache(cached=100)
    c.add_output([1, 2, 3, 4], None)
    c.add_output([5, 6, 7, 8], None)
    assert c.num_cached_tokens == 10
    c.add_output([9, 10], None)
    assert c.num_cached_requests == 2 and c.num_cached_tokens == 8


def test_max_cached_requests_zero_keeps_no_outputs() -> None:
    c = cache(cached=0)
    c.add_output([1, 2, 3], None)
    assert c.num_cached_requests == 0 and c.propose([9, 1, 2], None, 1) == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("suffix_decoding_max_tree_depth", 1),
        ("suffix_decoding_max_tree_depth", 65),
        ("suffix_decoding_max_cached_requests", -1),
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_max_spec_factor", float("nan")),
        ("suffix_decoding_min_token_prob", 1.5),
        ("suffix_decoding_min_token_prob", "0.1"),
    ],
)
def test_bad_suffix_config_names_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        EngineConfig(speculative_config={"method": "suffix", key: value})


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_output_is_identical_with_suffix_drafts(tiny_dir: Path, backend: str) -> None:
    params = [GREEDY] * len(PROMPTS)
    off = generate(make_core(tiny_dir, None, backend), params)
    core = make_core(tiny_dir, SUFFIX, backend)
    assert_same(off, generate(core, params))
    assert accepted(core) > 10


def test_a_repeated_request_is_drafted_from_the_first_ones_output(tiny_dir: Path) -> None:
    """The second request of the same prompt gets its drafts from the first's cached output (a prompt that never
    repeats itself, so its own tokens give few drafts), and its output is unchanged."""
    prompt = [[17, 3, 99, 42, 8, 61, 5, 23]]
    off = generate(make_core(tiny_dir, None), [GREEDY], prompt)
    core = make_core(tiny_dir, SUFFIX)
    first = generate(core, [GREEDY], prompt)
    assert core.scheduler.drafter is not None
    core.scheduler.drafter.stats = SpecDecodeStats()  # count the second request's drafts alone
    second = generate(core, [GREEDY], prompt)
    assert_same(off, first)
    assert_same(off, second)
    assert accepted(core) >= 20  # nearly every token of the 30 drafted and accepted


def test_pagoda_serve_passes_the_suffix_config_to_the_scheduler() -> None:
    """`pagoda serve --speculative-config` (parsed by the CLI) reaches the scheduler's own parser unchanged."""
    from services.cli import _parser
    from services.scheduler.config import parse_scheduler_args

    spec = '{"method": "suffix", "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_spec_factor": 2.5}'
    args = _parser().parse_args(["serve", "--speculative-config", spec])
    config = args.speculative_config
    assert (config.method, config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor) == (
        "suffix",
        32,
        2.5,
    )
    scheduler = parse_scheduler_args(["--speculative-config", config.to_json()])
    assert scheduler.speculative_config == config
    with pytest.raises(SystemExit):
        _parser().parse_args(
            ["serve", "--speculative-config", '{"method": "suffix", "suffix_decoding_max_tree_depth": 0}']
        )
