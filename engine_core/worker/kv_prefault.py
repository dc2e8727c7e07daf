"""Faults the host KV cache in while the engine is idle, so that a step's first K/V writes find their pages mapped.

The CPU cache is one lazily-faulted anonymous mapping (host_memory.py): cheap to create, but the first write to
each page is a fault, and on a VM whose host backs guest memory on demand a fresh worker paid ~2.7 s per GiB for
them. Paid inside steps, a 2,048-token prefill step's 94 MiB of fresh K/V were ~23,000 faults: `store_kv` took
136 of the step's 2,570 ms (4.5 ms per layer instead of ~0.3), in every step until the whole cache had been used.

A background thread asks the kernel to populate the pages (`madvise(MADV_POPULATE_WRITE)`, Linux >= 5.14: the
pages are mapped writable and their contents left as they are, so a block a step has already written keeps its
K/V). It walks the blocks in the order the block pool hands them out (ascending ids, every layer's K and V of a
chunk together), so the blocks the first requests get are the first ready.

NOTE: it only runs while no step does: the runner pauses it for each step, and a call (a chunk of `CHUNK_BLOCKS`
blocks of one layer's K or V, ~0.4 MiB, ~1 ms) starts only after `IDLE_S` without a step, so at most one call
overlaps a step's start, and only a step that follows a pause. A thread that ran alongside the steps at low priority
slowed the first request of `pagoda serve --demo` from 369 to 782 ms: page faults and memory bandwidth
are not shared by CPU priority. The thread releases the GIL in each call (ctypes).
NOTE: `IDLE_S` because steps run back to back with async scheduling (the next one is queued when one ends): a call
started in the microseconds between two steps ran ~1 ms into the next, ~10 % of a batch-1 step, in every step until
the walk was done (the first ~50 s after a start under load: the harness's batch-1 streams ran then).
NOTE: it walks no further than `AHEAD_BLOCKS` past the highest block the pool has handed out (`reached`, from each
step's new blocks): the pool hands out never-used blocks in ascending ids, so the blocks the next requests get are
the ones ready, and the cache's resident pages stay at what the steps used plus that margin instead of the whole
budget. The whole walk made the offline benchmark's KV part grow with the idle gaps a run happened to leave (the
steps' 1,255 MiB at the end of a quiet run, 1,312-1,445 MiB in loaded ones, the whole 2 GiB soon after `generate`
returned), and a serving worker's RSS the whole budget soon after start-up (docs/benchmarks.md, "Peak RSS of the
offline benchmark"). The price: a block beyond the margin is faulted by the step that first writes it, until the
pool has handed out every block once (what a fresh offline run paid: 3-8 %, "The KV cache's first-touch faults").
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import threading
import time
import weakref

import structlog
import torch

from engine_core.plan import SchedulerOutput

log = structlog.get_logger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14)
CHUNK_BLOCKS = 32  # blocks per call: 32 x 12 KiB for SmolLM2 at block size 16
IDLE_S = 0.005  # a call starts only after this long without a step
AHEAD_BLOCKS = CHUNK_BLOCKS  # blocks walked past the highest one handed out (~22 MiB for SmolLM2 in float32)
FRONTIER_POLL_S = 1.0  # a walk waiting for the pool's frontier checks this often whether its cache is gone
PAGE = 4096


def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def highest_new_block(plan: SchedulerOutput) -> int:
    """The highest block id among the blocks `plan` hands to sequences (new ones, growing ones, forks); -1 if none."""
    top = -1
    for new in plan.new_seqs:
        if new.block_ids:
            top = max(top, max(new.block_ids))
    for cached in plan.cached_seqs:
        if cached.new_block_ids:
            top = max(top, max(cached.new_block_ids))
    for delta in plan.beam_deltas:
        if delta.block_ids:
            top = max(top, max(delta.block_ids))
    return top


_started: weakref.WeakSet[KvPrefaulter] = weakref.WeakSet()


@atexit.register
def _join_at_exit() -> None:
    """Ends every walk before the interpreter finalizes.

    NOTE: a walk holds the cache during each madvise call. Where the engine is already gone (an `LLM` local to a
    script's `main()`), the walk's release is the last, and the cache is unmapped on the walk's thread with the GIL
    released; an interpreter that finalizes meanwhile ends that thread inside torch's buffer deleter, and the process
    aborted at exit ('terminate called without an active exception', exit status 134)."""
    walks = list(_started)
    for walk in walks:
        walk.close()
    for walk in walks:
        walk.join(timeout=10.0)


class KvPrefaulter:
    """Populates `cache` ([layers, 2, num_blocks, ...], contiguous, host memory) block chunk by block chunk.

    `pause()`/`resume()` bracket each step, `reached(block_id)` moves the frontier; `close()` stops the thread (it
    also ends once everything is mapped)."""

    def __init__(self, cache: torch.Tensor, chunk_blocks: int = CHUNK_BLOCKS, ahead_blocks: int = AHEAD_BLOCKS) -> None:
        assert cache.device.type == "cpu" and cache.is_contiguous() and cache.dim() >= 3
        # NOTE: a weak reference: an engine that is dropped frees its cache, and the walk ends at its next call
        # (a strong one is held only across each call, so the mapping never goes away under madvise).
        self._cache = weakref.ref(cache)
        self._chunk = chunk_blocks
        self._ahead = ahead_blocks
        self._frontier = 0  # 1 + the highest block id handed out so far
        self._advanced = threading.Event()  # set when the frontier moves (or the walk is closed)
        self._call_ranges = self._ranges(cache)
        self._idle = threading.Event()
        self._idle.set()
        self._idle_since = time.monotonic()
        self._closed = False
        self.bytes_done = 0
        self.total_bytes = cache.numel() * cache.element_size()
        self.unsupported = False  # the kernel has no MADV_POPULATE_WRITE (before 5.14) or madvise failed
        self.finished = False  # the thread has ended (walk done, closed, cache dropped or unsupported)
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)

    def start(self) -> None:
        _started.add(self)
        self._thread.start()

    def pause(self) -> None:
        if not self.finished:  # NOTE: once the walk is over a step costs one attribute read, not an Event's lock
            self._idle.clear()

    def resume(self) -> None:
        if not self.finished:
            self._idle_since = time.monotonic()
            self._idle.set()

    def reached(self, block_id: int) -> None:
        """A step writes `block_id`: the walk may go on to `ahead_blocks` past the highest such block."""
        if block_id >= self._frontier:
            self._frontier = block_id + 1
            self._advanced.set()

    def close(self) -> None:
        self._closed = True
        self._idle.set()
        self._advanced.set()

    def join(self, timeout: float | None = None) -> bool:
        """True once the thread has ended (done, closed or unsupported)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _ranges(self, cache: torch.Tensor) -> list[tuple[int, int, int]]:
        """(address, length, end block) per call, page-aligned, in block-allocation order."""
        layers, halves, num_blocks = cache.shape[:3]
        block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        base = cache.data_ptr()
        half_bytes = num_blocks * block_bytes
        out = []
        for b0 in range(0, num_blocks, self._chunk):
            n = min(self._chunk, num_blocks - b0)
            for layer in range(layers):
                for half in range(halves):
                    start = base + (layer * halves + half) * half_bytes + b0 * block_bytes
                    end = start + n * block_bytes
                    lo = start & ~(PAGE - 1)  # the mapping is page-aligned, so rounding stays inside it
                    out.append((lo, ((end + PAGE - 1) & ~(PAGE - 1)) - lo, b0 + n))
        return out

    def _run(self) -> None:
        try:
            self._walk()
        finally:
            self.finished = True

    def _wait_idle(self) -> None:
        """Returns once no step has run for `IDLE_S` (or the walk is closed)."""
        while True:
            self._idle.wait()
            left = IDLE_S - (time.monotonic() - self._idle_since)
            if left <= 0 or self._closed:
                return
            time.sleep(left)

    def _wait_frontier(self, end_block: int) -> bool:
        """Returns once the blocks below `end_block` are within the margin; False once closed or the cache is gone."""
        while True:
            if self._closed or self._cache() is None:
                return False
            if end_block <= self._frontier + self._ahead:
                return True
            self._advanced.clear()
            if end_block <= self._frontier + self._ahead:  # NOTE: moved between the check and the clear
                return True
            self._advanced.wait(FRONTIER_POLL_S)

    def _walk(self) -> None:
        madvise = _madvise()
        if madvise is None:
            self.unsupported = True
            return
        t0 = time.perf_counter()
        for addr, length, end_block in self._call_ranges:
            if not self._wait_frontier(end_block):
                return
            self._wait_idle()
            cache = self._cache()
            if self._closed or cache is None:
                return
            failed = madvise(addr, length, MADV_POPULATE_WRITE) != 0
            del cache
            if failed:
                self.unsupported = True
                log.info("KV cache left to fault lazily", errno=ctypes.get_errno())
                return
            self.bytes_done += length
        seconds = round(time.perf_counter() - t0, 2)
        log.info("KV cache faulted in", gib=round(self.total_bytes / (1 << 30), 3), seconds=seconds)
