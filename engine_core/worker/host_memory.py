"""Zero-filled host tensors that cost nothing until they are written: the CPU KV cache.

`torch.zeros` writes every byte, and the first write to fresh memory is a page fault: on this 2-core VM (whose host
maps guest memory on demand) 0.8-1.0 s per 256 MiB, so a 2 GiB KV cache took ~4 s of a `pagoda serve` start-up.
Anonymous `mmap` memory is zero by the kernel's guarantee and is faulted in on first write, so the cache is ready at
once and pages appear as sequences fill them (a block's K/V is written before any kernel reads it).

NOTE: the pages are faulted in ahead of use only while no step runs, and only a margin past the blocks the pool has
handed out (kv_prefault.py, started by the model runner): a step that writes K/V into a block beyond that for the
first time pays its fault (a 2,048-token prefill chunk: ~4.5 ms per layer in `store_kv`, ~0.3 ms once mapped).

NOTE: the price is that memory is committed lazily, as the pool first hands blocks out: a host with less free memory
than the KV budget would fail then rather than at allocation. So the budget is checked against what the host (and
the container's cgroup) has left before the mapping is made, and a budget that cannot fit is refused at once, naming
the setting.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


def available_host_bytes() -> int | None:
    """Memory this process can still get: MemAvailable, capped by a cgroup v2 limit (a pod's); None if unknown."""
    limits: list[int] = []
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype, setting: str) -> torch.Tensor:
    """A contiguous CPU tensor of zeros backed by anonymous memory (page-aligned).

    Raises ValueError naming `setting` when the host has not that much memory left."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    free = available_host_bytes()
    if free is not None and nbytes > free:
        raise ValueError(
            f"{setting}: {nbytes / (1 << 30):.2f} GiB asked for, but this host (or container) has only "
            f"{free / (1 << 30):.2f} GiB of memory left"
        )
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # NOTE: no MADV_HUGEPAGE: with this VM's THP `defrag=madvise`, every first write into a 2 MiB region zeroed (and
    # compacted for) a whole huge page: the first 40-token request spent 9.8 ms per layer in `store_kv` (294 of its
    # 370 ms), where 4 KiB faults cost a fraction of a millisecond for the pages its blocks touch.
    # NOTE: the tensor holds the buffer (and so the mapping) alive; the mapping is unmapped when the tensor dies.
    return torch.frombuffer(buf, dtype=dtype).view(shape)
