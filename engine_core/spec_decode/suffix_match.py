"""SuffixDecoding's speculation over one token log: match the context's suffix, then follow the most frequent path.

Arctic Inference keeps a suffix tree of bounded depth; its node for a string s counts the occurrences of s, and a
draft walks from the node of the longest matched context suffix to its most frequent child while the path's
probability (the product of child count / parent count) stays >= min_token_prob. Here the same walk is computed from
the occurrences themselves: the match is the set of positions where the context's last m tokens end (narrowed one
token back at a time with numpy), and each step of the path counts the tokens that follow the surviving positions.
The counts are the tree's (the occurrences of the path so far), with no tree kept: the memory is the token log
itself, and the work per proposal is proportional to the occurrences of the context's last token. Once a single
occurrence is left (a span being copied, the common case), the rest of its match and of its path are read in one
slice each instead of one numpy step per token (the scheduler proposes every decode step).

NOTE: the tree's depth bounds match + draft length, and the draft is at most spec_factor x the match: here the match
is taken up to `match_cap` tokens, the longest that leaves the draft its full room k (a shorter match with a longer
draft scores higher in Arctic's search over match lengths, and this picks that match directly); where k is more
than the depth allows (vLLM's suffix default: k = the depth), the match where both bounds meet, depth / (1 +
factor) tokens (12 of 24 at factor 1), and a draft of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SEP = -1  # between documents in a log: no token equals it, so a match or a path never crosses it


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the path's probabilities (Arctic's score)
    match_len: int = 0


def _run_back(log: np.ndarray, end: int, context: np.ndarray, limit: int) -> int:
    """How many tokens (at most `limit`) before `log[end + 1]` equal the context's last ones, read backwards."""
    n = min(limit, end + 1, len(context))
    if n <= 0:
        return 0
    same = log[end - n + 1 : end + 1][::-1] == context[len(context) - n :][::-1]
    return n if same.all() else int(np.argmin(same))


def match_cap(k: int, max_depth: int, spec_factor: float) -> int:
    """The longest context match to look for: match + draft <= max_depth and draft <= spec_factor x match."""
    balanced = int(max_depth / (1 + spec_factor))  # where spec_factor x match == max_depth - match
    return max(1, max_depth - k if k <= max_depth - balanced else balanced)


def suffix_draft(
    log: np.ndarray,
    ends: np.ndarray,
    context: np.ndarray,
    k: int,
    max_depth: int,
    spec_factor: float,
    min_prob: float,
) -> SuffixDraft:
    """The draft for what follows `context` from the documents in `log`.

    `ends`: ascending positions in `log` holding the context's last token (the candidates for a match of length 1);
    where `log` holds the context itself, its last position is not one of them."""
    if k < 1 or not len(ends) or not len(context):
        return SuffixDraft()
    cap = min(len(context), match_cap(k, max_depth, spec_factor))
    matched = ends
    m = 1
    while m < cap:
        if len(matched) == 1:  # one occurrence left: the rest of its match in one comparison
            m += _run_back(log, int(matched[0]) - m, context[: len(context) - m], cap - m)
            break
        back = matched - m
        ok = back >= 0
        ok[ok] = log[back[ok]] == context[-1 - m]
        if not ok.any():
            break
        matched = matched[ok]
        m += 1
    n = min(k, int(spec_factor * m), max_depth - m)
    draft = SuffixDraft(match_len=m)
    pos = matched + 1
    prob = 1.0
    while len(draft.token_ids) < n:
        if len(pos) == 1:  # one path left: its tokens up to a document's end, each at the same probability
            start = int(pos[0])
            tail = log[start : start + n - len(draft.token_ids)]
            ends_at = np.flatnonzero(tail == SEP)
            tail = tail[: ends_at[0]] if len(ends_at) else tail
            draft.token_ids += tail.tolist()
            draft.score += prob * len(tail)
            break
        total = len(pos)
        pos = pos[pos < len(log)]
        values = log[pos]
        live = values != SEP
        pos, values = pos[live], values[live]
        if not len(values):
            break
        uniq, counts = np.unique(values, return_counts=True)
        best = counts.max()
        tied = uniq[counts == best]
        # NOTE: ties go to the most recent occurrence (the latest text is the likeliest to be copied again)
        token = tied[0] if len(tied) == 1 else values[np.flatnonzero(np.isin(values, tied))[-1]]
        prob *= best / total
        if prob < min_prob:
            break
        draft.token_ids.append(int(token))
        draft.score += prob
        pos = pos[values == token] + 1
    return draft
