"""Prefix-cache keys: every full block is named by a hash chain over its parent's hash and its own tokens.

Two sequences that agree on their first k full blocks (and on the extra keys, such as a per-request `cache_salt`)
produce the same k hashes, so the second finds the first's K/V in the block pool.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_ROOT = b"pagoda-prefix-root"


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: str | None = None) -> bytes:
    # NOTE: sha256, not Python's hash(): a tenant must not be able to craft a collision with another's prefix.
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(b"\x00salt:" + extra_keys.encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    """Appends the hashes of every newly full block of `token_ids` to `hashes` (in place) and returns it."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        # The salt goes into the first block only: it changes every hash down the chain anyway.
        extra = cache_salt if i == 0 else None
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes
