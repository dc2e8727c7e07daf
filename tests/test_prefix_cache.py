"""Prefix-cache keys: a hash chain over full blocks, salted on the first block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.core.prefix_cache import extend_block_hashes, hash_block

tokens = st.lists(st.integers(0, 5), max_size=24)
salts = st.sampled_from([None, "tenant-a", "tenant-b"])
block_sizes = st.sampled_from([1, 2, 4])


def hashes_of(token_ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    return extend_block_hashes([], token_ids, block_size, salt)


def test_hash_depends_on_parent_tokens_and_salt() -> None:
    base = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == base
    assert len(base) == 32  # sha256
    assert hash_block(None, [2, 1]) != base
    assert hash_block(None, [1, 2, 0]) != base
    assert hash_block(base, [1, 2]) != base
    assert hash_block(None, [1, 2], "salt") != base
    assert hash_block(None, [1, 2], "salt") != hash_block(None, [1, 2], "other")


def test_only_full_blocks_are_hashed() -> None:
    assert hashes_of([1, 2, 3], 4) == []
    assert len(hashes_of([1, 2, 3, 4], 4)) == 1
    assert len(hashes_of(list(range(11)), 4)) == 2


def test_chain_links_each_block_to_its_parent() -> None:
    hs = hashes_of([1, 2, 3, 4, 5, 6], 2)
    assert hs == [
        hash_block(None, [1, 2]),
        hash_block(hs[0], [3, 4]),
        hash_block(hs[1], [5, 6]),
    ]
    # the same block content after a different prefix is a different key
    assert hashes_of([9, 9, 3, 4], 2)[1] != hs[1]


def test_salt_goes_into_the_first_block_only_and_changes_the_whole_chain() -> None:
    plain = hashes_of([1, 2, 3, 4], 2)
    salted = hashes_of([1, 2, 3, 4], 2, "tenant")
    assert salted[0] == hash_block(None, [1, 2], "tenant")
    assert salted[1] == hash_block(salted[0], [3, 4])
    assert not set(plain) & set(salted)


def test_extend_is_in_place_and_incremental() -> None:
    hs: list[bytes] = []
    out = extend_block_hashes(hs, [1, 2, 3], 2, None)
    assert out is hs and len(hs) == 1
    first = hs[0]
    extend_block_hashes(hs, [1, 2, 3, 4, 5], 2, None)
    assert hs[0] is first and hs == hashes_of([1, 2, 3, 4, 5], 2)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(a=tokens, b=tokens, block_size=block_sizes, salt=salts)
def test_two_sequences_share_exactly_their_common_full_blocks(
    a: list[int], b: list[int], block_size: int, salt: str | None
) -> None:
    ha, hb = hashes_of(a, block_size, salt), hashes_of(b, block_size, salt)
    assert len(ha) == len(a) // block_size
    common = 0
    while common < min(len(ha), len(hb)) and a[: (common + 1) * block_size] == b[: (common + 1) * block_size]:
        common += 1
    assert ha[:common] == hb[:common]
    # after the first differing block no hash matches at the same position (the chain carries the difference)
    assert all(x != y for x, y in zip(ha[common:], hb[common:], strict=False))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(t=tokens, block_size=block_sizes, split=st.integers(0, 24), salt=salts)
def test_incremental_extension_equals_hashing_at_once(
    t: list[int], block_size: int, split: int, salt: str | None
) -> None:
    hs = extend_block_hashes([], t[:split], block_size, salt)
    extend_block_hashes(hs, t, block_size, salt)
    assert hs == hashes_of(t, block_size, salt)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(t=st.lists(st.integers(0, 5), min_size=1, max_size=24), block_size=block_sizes)
def test_different_salts_never_share_a_block(t: list[int], block_size: int) -> None:
    a, b, none = (set(hashes_of(t, block_size, s)) for s in ("tenant-a", "tenant-b", None))
    assert not (a & b) and not (a & none) and not (b & none)
