"""glibc's malloc told to keep the memory a step frees, so the next step does not fault it in again.

A CPU step allocates its activations afresh (torch's CPU allocator is plain malloc): a 2,048-token prefill step
some 300 MB of them. By default glibc hands much of that back to the kernel when it is freed (chunks above its mmap
threshold are unmapped, a free top of the heap is trimmed, and a thread's own arena starts empty), and a later step
faults it in again, page by page, at several microseconds a fault on this 2-core VM. In the worker, whose steps run on
their own thread, the first 2,048-token step of a 64-stream load took 2.5-3.1 s with 26,000-118,000 page faults
against 2.3-2.5 s for the next ones, a delay that lands on every request's TTFT; some loads re-faulted over 50,000
pages in each of five or six later steps (docs/benchmarks.md, "The worker's allocator").

`retain_freed_memory` makes the process one heap that keeps what it frees: every thread allocates from the main
arena (M_ARENA_MAX 1), every chunk below 32 MiB comes from that heap (M_MMAP_THRESHOLD at its maximum, which also
stops glibc from starting at 128 KiB and raising it as chunks are freed) and the heap is trimmed only past 2 GiB of
free top (M_TRIM_THRESHOLD, the most mallopt takes). Freed activations are reused by later steps.

NOTE: chunks of 32 MiB and more (the model loader's temporaries; no activation of a 2,048-token step of the default
model is that large) are still mapped on their own and unmapped when freed. Mapping none (M_MMAP_MAX 0, tried first)
kept the loader's temporaries in the heap (~100 MB more RSS) and let one large size, allocated and freed again and
again, grow the heap by its size for up to a dozen rounds: torch's posix_memalign frees a small remainder beside each
chunk, which keeps the freed chunk from merging, so the next request of that size does not fit in it
(docs/decisions.md, "Memory").

NOTE: the price is that the process keeps its high-water mark of heap memory (the largest step's activations) while
large steps keep coming (the serving processes' peak RSS did not grow: 4.56-4.59 GB with it, 4.56-4.67 GB without;
4.88-4.92 GB with M_MMAP_MAX 0 or this threshold, in another window). `HeapRelease` (the runner's, after each step)
gives that room back once only small steps follow, in a worker as offline, and again when the engine goes idle
(`ModelRunner.release_idle_heap`: when `LLM.generate` returns; in a worker after a second without a step,
services/worker/server.py): `malloc_trim` is explicit, so the trim threshold above does not stop it. The KV cache is
not on the heap (host_memory.py maps it), so it is not affected.
These are process-wide settings: the worker applies them at start; the in-process `LLM` leaves its host process's
allocator alone (offline, where steps run on the main thread, it gained 1 %: inside the noise, docs/decisions.md,
"Memory").
"""

from __future__ import annotations

import ctypes
import platform

import structlog

log = structlog.get_logger(__name__)

# HeapRelease: a step a quarter of the largest since the last release or less is small; this many small steps in a
# row after a step of at least this many tokens mean the phase that filled the heap is over.
LARGE_STEP_TOKENS = 256
SETTLE_STEPS = 16

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can express (2 GiB of free top)
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); mallopt refuses more

# name (as logged) -> (mallopt parameter, value)
RETAIN_SETTINGS = {
    "arena_max": (M_ARENA_MAX, 1),
    "mmap_threshold": (M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
    "trim_threshold": (M_TRIM_THRESHOLD, _INT_MAX),
}


def retain_freed_memory() -> bool:
    """Applies RETAIN_SETTINGS to this process's glibc malloc; False (and nothing changed) where there is no glibc.

    Call it before the threads that run steps allocate anything: a thread keeps the arena of its first allocation,
    and glibc gives a new thread the arena of one that exited whatever M_ARENA_MAX says."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.info("allocator settings skipped: not glibc", system=platform.system())
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # NOTE: mallopt returns 1 on success; a failed setting leaves glibc's default for that one, which is still safe.
    failed = [name for name, (param, value) in RETAIN_SETTINGS.items() if mallopt(param, value) != 1]
    if failed:
        log.warning("allocator settings partly refused", refused=failed)
    else:
        log.info("allocator keeps freed memory", **{name: value for name, (_, value) in RETAIN_SETTINGS.items()})
    return not failed


def release_free_heap() -> bool:
    """Returns the heap's free pages to the kernel (`malloc_trim(0)`); False where there is no glibc.

    NOTE: called once, after the model load: the loader's float32 temporaries (decoded GGUF tensors, the weights
    before `coded_pack` and the panels) are freed by then, but under `retain_freed_memory` (a worker: chunks below
    32 MiB from the heap, no trim) they stayed in the heap as free, resident pages: 550 MiB of heap after the load,
    229 MiB once released (docs/benchmarks.md, "Peak RSS of the offline benchmark"). `malloc_trim(0)` releases every
    free page inside the heap, not only its top (glibc >= 2.8), and keeps the arena's layout, so a later step that
    needs the room faults it in once. Offline, glibc's default thresholds had already unmapped them: no change."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    trim = ctypes.CDLL(None).malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


class HeapRelease:
    """Gives the heap's free pages back once the large steps that left them are over: `release_free_heap` after
    `settle_steps` consecutive steps of at most a quarter of the largest step since the last release, where that one
    had at least `large_tokens` tokens.

    NOTE: why: the activations a step frees stay resident. Offline, glibc's dynamic mmap threshold rises to the
    largest chunk freed (a 2,048-token step's ~13 MiB MLP temporaries), so later steps allocate theirs from the heap
    and its free room is trimmed only past twice that; in a worker, `retain_freed_memory` keeps it all. Decode steps
    need a fraction of it, while the KV pages they write keep growing, so the offline run's peak RSS (at its end)
    carried the prefill steps' freed activations (docs/benchmarks.md, "Peak RSS of the offline benchmark").
    NOTE: relative to the largest step, so that verification steps (rows x (1 + k) tokens) after a prefill phase
    settle it as decode steps do; `settle_steps` so that a prefill phase's own gaps and a trickle of arrivals keep
    the room: the next large step after a release faults in what it needs again, once per burst.
    NOTE: per step, one or two comparisons."""

    def __init__(self, large_tokens: int = LARGE_STEP_TOKENS, settle_steps: int = SETTLE_STEPS) -> None:
        self.large_tokens = large_tokens
        self.settle_steps = settle_steps
        self._largest = 0  # the largest step since the last release, tokens
        self._small_steps = 0  # consecutive small steps since
        self._stepped = False  # a step ran since the last release (what `after_idle` gives back)
        self.releases = 0

    def after_step(self, num_tokens: int) -> None:
        self._stepped = True
        if num_tokens * 4 > self._largest:
            self._largest = max(self._largest, num_tokens)
            self._small_steps = 0
            return
        self._small_steps += 1
        if self._small_steps >= self.settle_steps and self._largest >= self.large_tokens:
            self._release()

    def after_idle(self) -> None:
        """The engine has nothing left to run (offline: a `generate` call has finished; a worker: no step for
        a second, services/worker/server.py): gives back what the steps since the last release left free.

        NOTE: why: the decode steps after the last release free their temporaries into the heap too (the random
        workload's heap grew ~15-30 MB above its level after the release), and offline the next call's fresh KV
        blocks (the harness's batch-1 calls) add to a peak that still held them. One trim per call that ran a step:
        a fraction of a millisecond when little is free (docs/benchmarks.md, "Peak RSS of the offline benchmark")."""
        if self._stepped:
            self._release()

    def _release(self) -> None:
        self._largest = self._small_steps = 0
        self._stepped = False
        release_free_heap()
        self.releases += 1
