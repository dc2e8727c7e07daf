"""The collectives a tensor-parallel step makes: an all-reduce after each row-parallel projection and the vocab
embedding, the LM head's logits gathered to rank 0, and rank 0's sampled tokens broadcast to the others (whose
persistent batch feeds them back as the next decode inputs). The time spent in them is counted per step
(`CollectiveClock`) for the step's profile.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CollectiveClock:
    """Seconds this process spent inside collectives since the last `take` (the runner takes them once per step into
    its `StepTimings`), and in all (`total`, for benchmarks)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.total = 0.0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        self.total += s
        return s


CLOCK = CollectiveClock()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums `x` over the group, in place (callers check the size: no call at all without tensor parallelism)."""
    t0 = time.perf_counter()
    dist.all_reduce(x)
    CLOCK.seconds += time.perf_counter() - t0
    return x


def gather_last_dim(x: torch.Tensor, rank: int, size: int) -> torch.Tensor | None:
    """Rank 0 gets every rank's `x` concatenated along the last dimension; the others get None."""
    t0 = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    CLOCK.seconds += time.perf_counter() - t0
    return None if parts is None else torch.cat(parts, dim=-1)


def broadcast_from_driver(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place; every rank passes a tensor of the same shape and dtype)."""
    t0 = time.perf_counter()
    dist.broadcast(x, src=0)
    CLOCK.seconds += time.perf_counter() - t0
    return x
