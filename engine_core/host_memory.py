"""Zero-filled host tensors that cost nothing until they are written: the CPU KV cache.

`torch.zeros` writes every byte, and the first write to fresh memory is a page fault: on this 2-core VM (whose host
maps guest memory on demand) 0.8-1.0 s per 256 MiB, so a 2 GiB KV cache took ~4 s of a `pagoda serve` start-up.
Anonymous `mmap` memory is zero by the kernel's guarantee and is faulted in on first write, so the cache is ready at
once and pages appear as sequences fill them (a block's K/V is written before any kernel reads it).

A daemon thread at the lowest CPU priority then faults the pages in (`populate_in_background`), so an idle server
has its cache resident before traffic comes, without the start-up waiting for it.

NOTE: the price is that memory is committed lazily: a host with less free memory than the KV budget would fail under
load rather than at start-up. So the budget is checked against what the host (and the container's cgroup) has left
before the mapping is made, and a budget that cannot fit is refused at once, naming the setting.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
from pathlib import Path

import torch

_MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux >= 5.14; Python 3.11's mmap module lacks the name
_POPULATE_CHUNK = 64 << 20
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
    """A contiguous CPU tensor of zeros backed by anonymous memory (page-aligned; huge pages where allowed).

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
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # NOTE: with transparent huge pages in `madvise` mode (this VM's setting) the attention kernels' K/V reads then
        # walk 2 MiB pages (fewer TLB misses) and a first write faults 2 MiB at a time.
        buf.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: the tensor holds the buffer (and so the mapping) alive; the mapping is unmapped when the tensor dies.
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def populate_in_background(t: torch.Tensor) -> None:
    """Faults in the pages of a `zeroed_host_tensor` from a daemon thread at nice 19, 64 MiB at a time.

    MADV_POPULATE_WRITE maps the pages without writing to them, so it is safe while the engine writes K/V; where the
    kernel lacks it (before 5.14, not Linux) the pages stay faulted on first write. NOTE: ctypes releases the GIL for
    the call, so the engine's Python threads are not held up; at nice 19 the thread yields the cores to any busy
    thread of the engine.
    """
    if not hasattr(os, "setpriority"):
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int

    def populate() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux: per-thread nice)
        base, size = t.data_ptr(), t.numel() * t.element_size()
        for offset in range(0, size, _POPULATE_CHUNK):
            if madvise(base + offset, min(_POPULATE_CHUNK, size - offset), _MADV_POPULATE_WRITE) != 0:
                return  # unsupported (EINVAL) or no memory (ENOMEM): first writes fault the rest in

    # NOTE: the thread holds `t`, so the mapping outlives a cache that is replaced while it runs.
    threading.Thread(target=populate, name="populate-kv-cache", daemon=True).start()
