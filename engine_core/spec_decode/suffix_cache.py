"""The `suffix` method's proposer (SuffixDecoding, Arctic Inference; vLLM's `suffix`): drafts from the request's own
prompt and output, and from the outputs of recent requests of the same tenant.

Finished requests' outputs are kept per tenant (the request's `cache_salt`, as the prefix cache scopes its blocks: no
salt is one shared tenant), each in an append-only token log with an index from token to positions, so a proposal
looks only at the occurrences of the context's last token. A tenant's drafts are built from its own log only: a
request never receives another salt's continuation. The cache is bounded by `suffix_decoding_max_cached_requests`
(vLLM's key; 0 turns the cross-request cache off) and by MAX_CACHED_TOKENS, evicting the oldest output first (FIFO,
as Arctic's cache).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine_core.spec_decode.suffix_match import SEP, SuffixDraft, suffix_draft

# NOTE: 16 bytes a cached token (the log and its index): 32 MiB at most, whatever the request count allows.
MAX_CACHED_TOKENS = 1 << 21


@dataclass
class _TenantLog:
    """One tenant's cached outputs: SEP, doc, SEP, doc, ...; positions below `start` are evicted."""

    tokens: array = field(default_factory=lambda: array("q"))
    index: dict[int, array] = field(default_factory=dict)  # token -> its positions, ascending
    start: int = 0

    def append(self, doc: list[int]) -> int:
        base = len(self.tokens)
        self.tokens.append(SEP)
        self.tokens.extend(doc)
        index = self.index
        for i, t in enumerate(doc, base + 1):
            positions = index.get(t)
            if positions is None:
                index[t] = positions = array("q")
            positions.append(i)
        return len(doc) + 1

    def evict(self, length: int) -> None:
        self.start += length
        if self.start > len(self.tokens) // 2:
            self._compact()

    def _compact(self) -> None:
        """Drops the evicted prefix (amortised: at most once per half of the log)."""
        self.tokens = self.tokens[self.start :]
        self.start = 0
        self.index = self._rebuild(self.tokens)

    @staticmethod
    def _rebuild(tokens: array) -> dict[int, array]:
        values = np.frombuffer(tokens, dtype=np.int64) if len(tokens) else np.zeros(0, np.int64)
        order = np.argsort(values, kind="stable")
        uniq, first = np.unique(values[order], return_index=True)
        groups = np.split(order, first[1:])
        return {int(t): array("q", g.tolist()) for t, g in zip(uniq, groups, strict=True) if t != SEP}

    def ends(self, token: int) -> np.ndarray:
        positions = self.index.get(token)
        if positions is None or not len(positions):
            return np.zeros(0, dtype=np.int64)
        found = np.frombuffer(positions, dtype=np.int64)
        return found[found >= self.start]

    def view(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=np.int64)


class SuffixCache:
    def __init__(self, max_depth: int, max_cached_requests: int, spec_factor: float, min_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.spec_factor = spec_factor
        self.min_prob = min_prob
        self._tenants: dict[str | None, _TenantLog] = {}
        self._order: deque[tuple[str | None, int]] = deque()  # cached outputs, oldest first: (salt, log length)
        self.num_cached_tokens = 0

    @property
    def num_cached_requests(self) -> int:
        return len(self._order)

    def propose(self, token_ids: list[int], salt: str | None, k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids`: the better scored of the request's own draft and its tenant's."""
        if k < 1 or len(token_ids) < 2:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        last = seq[-1]
        context = seq[-self.max_depth :]
        own = np.flatnonzero(seq[:-1] == last)
        best = self._draft(seq, own, context, k)
        tenant = self._tenants.get(salt)
        if tenant is not None:
            other = self._draft(tenant.view(), tenant.ends(int(last)), context, k)
            if other.score > best.score:
                best = other
        return best.token_ids

    def _draft(self, log: np.ndarray, ends: np.ndarray, context: np.ndarray, k: int) -> SuffixDraft:
        return suffix_draft(log, ends, context, k, self.max_depth, self.spec_factor, self.min_prob)

    def add_output(self, output_ids: list[int], salt: str | None) -> None:
        """A finished request's output joins its tenant's cache (the oldest outputs leave first past the bounds)."""
        if self.max_cached_requests == 0 or not output_ids:
            return
        doc = output_ids[: MAX_CACHED_TOKENS - 1]
        tenant = self._tenants.get(salt)
        if tenant is None:
            tenant = self._tenants[salt] = _TenantLog()
        length = tenant.append(doc)
        self._order.append((salt, length))
        self.num_cached_tokens += length
        while len(self._order) > self.max_cached_requests or self.num_cached_tokens > MAX_CACHED_TOKENS:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        salt, length = self._order.popleft()
        self.num_cached_tokens -= length
        tenant = self._tenants[salt]
        tenant.evict(length)
        if tenant.start == len(tenant.tokens):
            del self._tenants[salt]
