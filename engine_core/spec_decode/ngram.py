"""The n-gram proposer (prompt lookup decoding): the continuation of the latest n-gram's earlier occurrence."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the sequence's last n tokens, trying the
    longest n in [n_min, n_max] first; [] when no n-gram recurs.

    NOTE: one vectorised pass per n over the sequence (numpy compares all windows at once); the scheduler calls it
    only for small batches (SpeculativeConfig.disable_by_batch_size), so it never runs on large steps.
    """
    length = len(token_ids)
    if k < 1 or length < n_min + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        # Windows starting before the tail itself: starts 0 .. length - n - 1.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence's continuation
            return token_ids[start : start + k]
    return []
