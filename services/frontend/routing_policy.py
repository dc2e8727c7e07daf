"""Which scheduler replica gets a request: `round_robin`, `least_load` or `prefix` (the default).

`prefix` follows SGLang's cache-aware router: while the replicas' loads are balanced it sends a request to the replica
that holds the longest run of its leading prefix-cache blocks (the prefill it saves), ties and no-overlap cases to
the least loaded; once the loads are imbalanced (the busiest has more than `BALANCE_ABS` requests over the idlest and
more than `BALANCE_REL` times its load) it routes by load alone until they even out, so one hot tenant cannot pile its
requests onto one replica. The load of a replica is what it last reported (running + waiting requests) plus the
requests this frontend routed to it since (optimistic accounting: a burst does not all land on one replica before
its next report).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

ROUTING_POLICIES = ("round_robin", "least_load", "prefix")
# NOTE: SGLang's defaults are 64 and 1.5 for replicas of up to hundreds of running requests; a CPU replica here runs
# tens, so the absolute threshold is scaled down.
BALANCE_ABS = 16
BALANCE_REL = 1.5


@dataclass(frozen=True)
class ReplicaView:
    """One ready replica as the policy sees it."""

    name: str
    load: int  # requests: reported running + waiting, plus routed here since the report
    cached_blocks: int  # leading blocks of this request's hash chain the replica holds


def imbalanced(loads: list[int]) -> bool:
    hi, lo = max(loads), min(loads)
    return hi - lo > BALANCE_ABS and hi > lo * BALANCE_REL


class RoutingPolicy:
    def __init__(self, name: str) -> None:
        if name not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {name!r}")
        self.name = name
        self._turn = itertools.count()

    @property
    def wants_overlap(self) -> bool:
        """Whether `choose` reads `cached_blocks` (the caller hashes the prompt only then)."""
        return self.name == "prefix"

    def choose(self, replicas: list[ReplicaView]) -> ReplicaView:
        if not replicas:
            raise ValueError("no replica to choose from")
        turn = next(self._turn) % len(replicas)
        # NOTE: rotated, so equal loads (an idle cluster, no overlap) take turns instead of all going to the first.
        rotated = replicas[turn:] + replicas[:turn]
        if self.name == "round_robin":
            return rotated[0]
        least = min(rotated, key=lambda r: r.load)
        if self.name == "least_load" or imbalanced([r.load for r in replicas]):
            return least
        best = max(rotated, key=lambda r: (r.cached_blocks, -r.load))
        return best if best.cached_blocks > 0 else least
