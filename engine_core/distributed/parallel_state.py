"""This process's rank in the tensor-parallel group and the torch.distributed group the collectives run over.

The shard a rank loads needs only `TensorParallel` (rank, size), known when the model loads (the worker's flags, the
offline launcher's arguments); the process group is formed later, at every KV cache initialisation (`form_group`),
and torn down first if one exists, so that a group re-formed after a rank restarted works.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger(__name__)

# NOTE: a collective that waits this long for a peer has lost it; gloo reports a dead peer's closed socket at once,
# this bounds a hung (alive but stuck) one.
GROUP_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of the model this process holds: `rank` of `size` (size 1: the whole model, no collectives)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside tensor_parallel_size {self.size}")

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the step's tokens; the others only compute their shard."""
        return self.rank == 0


SINGLE = TensorParallel()


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuses a `size` that does not split the heads: each rank holds num_heads / size query heads and either
    num_kv_heads / size KV heads or (num_kv_heads < size) one KV head replicated on size / num_kv_heads ranks."""
    if num_heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {num_heads} attention heads; "
            f"choose a divisor of {num_heads}"
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} neither divides nor is a multiple of the model's {num_kv_heads} KV heads"
        )


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def form_group(tp: TensorParallel, init_addr: str, device: torch.device, epoch: str) -> None:
    """Joins (re-joins) the group at `init_addr` (host:port, rank 0 listens there): gloo on CPU, NCCL on CUDA.
    Every rank must call it with the same address and `epoch` (the cache epoch it is formed for); it returns when all
    `tp.size` ranks have joined.

    NOTE: the rendezvous keys are the epoch's (a `PrefixStore`), and rank 0 keeps one store server for its lifetime:
    with one key space, a restarted rank that reached the address first rendezvoused with the previous group's
    leftover keys and went on alone, while rank 0 waited for it (seen: a recovery stuck for minutes)."""
    leave_group()
    if tp.size == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NOTE: NCCL's communicator binds to the current device
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"pagoda/{epoch}", _store(tp, init_addr)),
        rank=tp.rank,
        world_size=tp.size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    log.info("tensor-parallel group formed", rank=tp.rank, size=tp.size, backend=backend, addr=init_addr, epoch=epoch)


_server: tuple[str, dist.TCPStore] | None = None  # rank 0's store server and its address, kept across groups


def _store(tp: TensorParallel, init_addr: str) -> dist.TCPStore:
    """Rank 0: its store server at `init_addr` (started once); the others: a client of it (retries until it is up)."""
    global _server
    host, _, port = init_addr.rpartition(":")
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if tp.rank != 0:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    if _server is None or _server[0] != init_addr:
        _server = (init_addr, dist.TCPStore(host, int(port), is_master=True, timeout=timeout, wait_for_workers=False))
    return _server[1]


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def group_formed() -> bool:
    return dist.is_available() and dist.is_initialized()
