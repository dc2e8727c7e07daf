"""How many KV blocks a workload touches, under the block pool's free order and under a recycle-first order.

Replays a workload (`workload.py`) through the engine's real `Scheduler` and `BlockPool`, without a model: every
row the scheduler says is sampled gets a token that depends only on its sequence and position, so block counts,
hashes of prompt blocks and prefix-cache hits are what `LLM.generate` gets (outputs are `ignore_eos` and fixed-length,
so scheduling does not depend on token values). Reports, per order: the blocks in use at once (most), the distinct
blocks ever handed out (the KV cache pages a run faults in, 0.70 MiB each for SmolLM2), evictions, and the prefix
cache's hits.

Orders:
- pool: the engine's (`BlockPool`): never-used blocks before cached free ones, so nothing cached is evicted while
  the pool has a block that was never used; a run touches fresh pages until its cumulative allocation reaches the
  pool's size.
- recycle: a free block that was used before (LRU first) before any never-used one; pages touched = the most in
  use at once, at the price of evicting cached blocks the pool would have kept.
- answers-first: a freed block that holds a generated token goes to the head of the free queue, as an uncached
  one does (the same prompts hit as under `pool`; a next turn whose prompt contains the previous answer does not).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_touch.py [--workloads random,prefix] [--kv-cache-gib 2] \
        [--rounds 2 [--next-turn]]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from workload import Workload, make

from engine_core.config import EngineConfig
from engine_core.core.block_pool import BlockPool, KVBlock
from engine_core.core.kv_cache_manager import KVCacheManager
from engine_core.core.request import Request, Sequence
from engine_core.core.scheduler import Scheduler
from engine_core.plan import ModelRunnerOutput
from engine_core.sampling_params import SamplingParams

SMOLLM2_BLOCK_BYTES = 2 * 16 * 3 * 64 * 4 * 30  # K and V, 16 tokens, 3 KV heads x 64, float32, 30 layers
VOCAB = 49152


class TouchCounting:
    """Wraps a pool's allocate: records every block id handed out; `recycle` takes used free blocks first."""

    def __init__(self, pool: BlockPool, recycle: bool) -> None:
        self.pool, self.recycle = pool, recycle
        self.touched: set[int] = set()
        self._allocate = pool.allocate
        pool.allocate = self.allocate  # type: ignore[method-assign]

    def allocate(self, n: int) -> list[KVBlock]:
        if not self.recycle:
            out = self._allocate(n)
        else:
            used = [b for b in self.pool.free_queue if b.block_id in self.touched][:n]
            for b in used:  # NOTE: taken out of the LRU order as `allocate` would, then evicted
                self.pool.free_queue.remove(b)
                self.pool.free_queue.appendleft(b)
            out = self._allocate(n)
        self.touched.update(b.block_id for b in out)
        return out


def answers_first(kv: KVCacheManager) -> None:
    """Wraps kv's free: a freed cached block that holds a generated token moves to the head of the free queue."""
    free = kv.free

    def wrapped(seq: Sequence) -> None:
        table = kv.tables.get(seq.seq_id, [])
        answers = [b for i, b in enumerate(table) if (i + 1) * kv.block_size > seq.num_prompt_tokens]
        free(seq)
        queue = kv.pool.free_queue
        for block in answers:
            if block.ref_cnt == 0 and block.block_hash is not None:
                queue.remove(block)
                queue.appendleft(block)

    kv.free = wrapped  # type: ignore[method-assign]


@dataclass
class Replay:
    order: str
    workload: str
    max_in_use: int
    touched: int
    evictions: int
    hit_tokens: int
    query_tokens: int

    def line(self) -> str:
        mib = self.touched * SMOLLM2_BLOCK_BYTES / (1 << 20)
        hit = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return (
            f"{self.workload:7s} {self.order:13s} most in use {self.max_in_use:5d}  touched {self.touched:5d} "
            f"({mib:6.0f} MiB)  evictions {self.evictions:5d}  prefix hits {self.hit_tokens}/{self.query_tokens} "
            f"({hit:.1%})"
        )


NEXT_TURN_TOKENS = 16  # a next turn's new user tokens after the previous answer


def replay(workload: str, order: str, num_requests: int, num_blocks: int, rounds: int, next_turn: bool) -> Replay:
    config = EngineConfig.from_kwargs(model=None)
    sched = Scheduler(config, 8192, num_blocks)
    counter = TouchCounting(sched.kv.pool, recycle=order == "recycle")
    if order == "answers-first":
        answers_first(sched.kv)
    max_in_use = 0
    arrivals = 0
    # NOTE: `rounds` generate calls one after another: of the same prompts (a script that runs its batch again), or
    # with `next_turn` each prompt the previous round's prompt + answer + new tokens (a multi-turn chat). A later
    # round hits whatever the earlier ones left in the cache.
    wl = make(workload, num_requests, 0)
    texts: dict[str, list[int]] = {}  # request id -> prompt + sampled tokens
    for rnd in range(rounds):
        warm = make("random", 2, seed=12345) if rnd == 0 else None
        for batch in ([warm] if warm else []) + [wl]:
            lens = batch.output_lens if batch is wl else [8, 8]
            turn: list[str] = []
            for prompt, n in zip(batch.prompts, lens, strict=True):
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                rid = f"r{arrivals}"
                sched.add_request(Request(rid, list(prompt), params))
                texts[rid] = list(prompt)
                turn.append(rid)
                arrivals += 1
            while sched.has_unfinished:
                plan = sched.schedule()
                pool = sched.kv.pool
                max_in_use = max(max_in_use, pool.num_blocks - pool.num_free)
                out = ModelRunnerOutput()
                for seq_id in plan.num_scheduled_tokens:
                    seq = sched.seqs.get(seq_id)
                    if seq is not None and seq.num_pending:
                        token = (seq_id * 7919 + seq.num_tokens) % VOCAB
                        out.seq_ids.append(seq_id)
                        out.sampled_token_ids.append(token)
                        texts[seq.request.request_id].append(token)
                sched.update(out)
            if next_turn and batch is wl:
                new = [[(7 * i + j) % VOCAB for j in range(NEXT_TURN_TOKENS)] for i in range(len(turn))]
                wl = Workload(
                    wl.name, [texts[rid] + extra for rid, extra in zip(turn, new, strict=True)], wl.output_lens
                )
    stats = sched.kv.stats
    return Replay(
        order,
        workload,
        max_in_use,
        len(counter.touched),
        sched.kv.pool.num_evictions,
        stats.hits,
        stats.queries,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="random,prefix")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=1, help="calls of the same prompts in a row")
    ap.add_argument("--next-turn", action="store_true", help="a later round's prompts: prompt + answer + new tokens")
    args = ap.parse_args()
    num_blocks = int(args.kv_cache_gib * (1 << 30)) // SMOLLM2_BLOCK_BYTES
    print(f"{num_blocks} blocks ({args.kv_cache_gib:g} GiB of SmolLM2's float32 KV cache), {args.rounds} round(s)")
    for name in args.workloads.split(","):
        for order in ("pool", "recycle", "answers-first"):
            print(replay(name, order, args.num_requests, num_blocks, args.rounds, args.next_turn).line(), flush=True)


if __name__ == "__main__":
    main()
