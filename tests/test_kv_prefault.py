"""The KV cache prefaulter: every page up to its margin past the pool's frontier mapped in, contents untouched, and
nothing done while a step runs."""

from __future__ import annotations

import ctypes
import ctypes.util
import time

import pytest
import torch

from engine_core.plan import BeamDelta, CachedSequenceData, NewSequenceData, SchedulerOutput
from engine_core.sampling_params import SamplingParams
from engine_core.worker import kv_prefault
from engine_core.worker.host_memory import zeroed_host_tensor
from engine_core.worker.kv_prefault import KvPrefaulter, highest_new_block

PAGE = 4096


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's pages that are mapped in (mincore(2))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = t.data_ptr() & ~(PAGE - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def cache(num_blocks: int = 50) -> torch.Tensor:
    # [layers, K/V, blocks, block_size, kv_heads, head_dim]: 12 KiB blocks, as SmolLM2's at block size 16
    return zeroed_host_tensor((3, 2, num_blocks, 16, 3, 64), torch.float32, "kv_cache_memory")


def finished(p: KvPrefaulter) -> None:
    assert p.join(timeout=30)
    if p.unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")


def test_every_page_is_mapped_and_written_blocks_keep_their_contents() -> None:
    kv = cache()
    kv[1, 0, 7].fill_(1.5)  # a block a step wrote before the prefaulter reached it
    kv[2, 1, 49].fill_(-2.0)
    assert resident_fraction(kv) < 0.1
    p = KvPrefaulter(kv, chunk_blocks=8)
    p.reached(49)  # the pool has handed out its last block
    p.start()
    finished(p)
    assert resident_fraction(kv) == 1.0
    assert p.bytes_done >= p.total_bytes
    assert bool((kv[1, 0, 7] == 1.5).all()) and bool((kv[2, 1, 49] == -2.0).all())
    assert int(torch.count_nonzero(kv)) == 2 * kv[0, 0, 0].numel()


def test_nothing_is_faulted_while_paused_and_the_walk_resumes() -> None:
    kv = cache()
    p = KvPrefaulter(kv, chunk_blocks=8)
    p.reached(49)
    p.pause()  # as the runner does for a step
    p.start()
    assert not p.join(timeout=0.3)
    assert p.bytes_done == 0 and resident_fraction(kv) == 0.0
    p.resume()
    finished(p)
    assert resident_fraction(kv) == 1.0


def test_steps_back_to_back_leave_no_gap_for_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling queues the next step before one ends: the walk waits for a real pause (IDLE_S)."""
    kv = cache(400)
    p = KvPrefaulter(kv, chunk_blocks=1)
    p.reached(399)
    p.start()
    assert not p.join(timeout=0.0)
    # NOTE: a pause of 0.2 s instead of 5 ms, so that a loaded machine delaying this thread's next pause() by a few
    # ms does not count as a gap; the walk reads IDLE_S at every wait.
    monkeypatch.setattr(kv_prefault, "IDLE_S", 0.2)
    p.pause()
    done = p.bytes_done
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # steps of ~1 ms with ~50 us between them
        p.resume()
        time.sleep(0.00005)
        p.pause()
        time.sleep(0.001)
    call = 12 * 1024 + PAGE  # one call of one 12 KiB block, page-rounded
    assert p.bytes_done <= done + 2 * call  # at most what was under way when the steps began
    p.resume()
    finished(p)
    assert resident_fraction(kv) == 1.0


def test_close_stops_the_walk() -> None:
    kv = cache(400)
    p = KvPrefaulter(kv, chunk_blocks=1)
    p.pause()
    p.start()
    p.close()
    assert p.join(timeout=10)
    assert p.bytes_done == 0


def test_a_dropped_cache_ends_the_walk() -> None:
    kv = cache(400)
    p = KvPrefaulter(kv, chunk_blocks=1)
    p.pause()
    p.start()
    del kv  # the engine that owned it is gone: its memory is freed, not faulted in
    p.resume()
    assert p.join(timeout=10)
    assert p.bytes_done == 0


def block_resident(kv: torch.Tensor) -> list[bool]:
    """Per block: whether every layer's K and V pages of it are mapped in."""
    return [
        all(resident_fraction(kv[layer, half, b]) == 1.0 for layer in range(kv.shape[0]) for half in range(2))
        for b in range(kv.shape[2])
    ]


def wait_for(p: KvPrefaulter, nbytes: int) -> None:
    deadline = time.monotonic() + 30
    while p.bytes_done < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_walk_stays_within_its_margin_past_the_blocks_handed_out() -> None:
    """The pool hands out never-used blocks in ascending ids: the walk maps blocks up to `ahead_blocks` past the
    highest one a step has written, and no further until a step writes a higher one."""
    kv = cache(64)
    p = KvPrefaulter(kv, chunk_blocks=4, ahead_blocks=8)
    p.start()
    block = kv[0, 0, 0].numel() * kv.element_size()
    layers_halves = kv.shape[0] * 2
    wait_for(p, 8 * block * layers_halves)  # nothing handed out yet: the first 8 blocks
    time.sleep(0.3)  # and nothing more, however long the engine stays idle
    if p.unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert p.bytes_done == 8 * block * layers_halves
    assert block_resident(kv) == [b < 8 for b in range(64)]
    p.reached(13)  # a step wrote blocks up to 13: the walk goes on to 13 + 1 + 8 = 22, rounded down to its chunks
    wait_for(p, 20 * block * layers_halves)
    time.sleep(0.3)
    assert block_resident(kv) == [b < 20 for b in range(64)]
    p.reached(5)  # a lower block (one the pool recycled) moves nothing
    time.sleep(0.3)
    assert p.bytes_done == 20 * block * layers_halves
    p.reached(63)
    finished(p)
    assert resident_fraction(kv) == 1.0


def test_a_walk_waiting_at_its_margin_ends_when_the_cache_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_prefault, "FRONTIER_POLL_S", 0.05)
    kv = cache(400)
    p = KvPrefaulter(kv, chunk_blocks=1, ahead_blocks=2)
    p.start()
    wait_for(p, 1)
    del kv
    assert p.join(timeout=10)
    assert p.finished


def test_highest_new_block_reads_every_kind_of_new_block() -> None:
    params = SamplingParams(max_tokens=1)
    plan = SchedulerOutput(
        new_seqs=[NewSequenceData(1, [5, 6], 2, params, None, [3, 9], 0)],
        cached_seqs=[CachedSequenceData(2, [], 4), CachedSequenceData(3, [12, 7], 4)],
        beam_deltas=[BeamDelta(4, 3, 0, [1, 2, 30])],
    )
    assert highest_new_block(plan) == 30
    plan.beam_deltas = []
    assert highest_new_block(plan) == 12
    assert highest_new_block(SchedulerOutput()) == -1


@pytest.mark.slow
def test_an_idle_engine_walks_only_a_margin_past_the_blocks_its_steps_used(smollm2_dir: str) -> None:
    """Through the runner: each step's new blocks move the walk's frontier, and an idle engine's resident KV stays
    at the blocks handed out plus `AHEAD_BLOCKS` (the whole cache was resident soon after start-up)."""
    from engine_core import LLM, SamplingParams

    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.25)
    runner = llm.engine.runner
    walk, kv, pool = runner.kv.prefaulter, runner.kv._whole, llm.engine.core.scheduler.kv.pool
    assert walk is not None and kv is not None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(1000 * (i + 1), 1000 * (i + 1) + 200 + 16 * i)) for i in range(3)]  # no shared prefix
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    used = [b.block_id for b in pool.blocks if b.block_hash is not None]  # the full blocks the steps wrote, cached
    assert len(used) >= 3 * (200 + 40) // 16 - 3
    time.sleep(1.0)  # idle: the walk has its gaps
    if walk.unsupported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    resident = block_resident(kv)
    assert all(resident[b] for b in used)
    limit = max(used) + 1 + kv_prefault.AHEAD_BLOCKS + 1  # + the partial last blocks the pool handed out after them
    assert not any(resident[limit + kv_prefault.CHUNK_BLOCKS :])
    assert sum(resident) < pool.num_blocks // 2
