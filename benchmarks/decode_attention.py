"""The decode attention of one engine-shaped decode step: the native paged kernel over every layer of SmolLM2-135M
(9 query / 3 KV heads, head dim 64, block size 16, 30 layers, one cache per layer so the K/V come from DRAM as in
the engine), 64 sequences of 100-700 tokens, over a bf16 and a float32 cache, beside the read bandwidth measured in
the same run (batch1_roofline.py's probe: a sum over a 1 GiB float32 buffer, the same threads).

Blocks are laid out as the engine's pool hands them out: each sequence's prompt (its first ~40 % of blocks) in one
run, then the blocks decoding adds, one per sequence in turn. Each round times, per cache dtype, the step's layers
best of `--repeats` (wall, and the process's CPU time over the threads: on a shared machine a 2-thread step's wall
time depends on the other jobs, and one thread's CPU time is the kernel's own cost) and the probe, so both sides of
a ratio see the same machine load. `cpu_bench.py
attention` times one layer over several shapes and against the torch backend; this one is for A/B of kernel builds:
run it in each build's tree, alternated.

    PYTHONPATH=$PWD python benchmarks/decode_attention.py [--rounds 3] [--threads 2] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch1_roofline import read_bandwidth_gbs  # the same probe as the batch-1 roofline's

RESULTS = Path(__file__).parent / "results" / "decode_attention.jsonl"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def engine_tables(lens: list[int], g: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block tables as the pool allocates them: prompts' blocks contiguous, decode's blocks interleaved."""
    need = [-(-n // BLOCK) for n in lens]
    prompt = [max(1, int(0.4 * b)) for b in need]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    nxt = 1  # block 0 left out, as the pool keeps it
    for i, b in enumerate(prompt):
        tables[i, :b] = torch.arange(nxt, nxt + b, dtype=torch.int32)
        nxt += b
    filled = list(prompt)
    while any(f < n for f, n in zip(filled, need, strict=True)):
        for i in torch.randperm(len(lens), generator=g).tolist():
            if filled[i] < need[i]:
                tables[i, filled[i]] = nxt
                filled[i] += 1
                nxt += 1
    return tables, nxt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--min-ctx", type=int, default=100)
    ap.add_argument("--max-ctx", type=int, default=700)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="steps timed per round and dtype (best kept)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tag", default="", help="a label for the results line (e.g. the build)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        sys.exit("the native CPU kernels are unavailable (no C++ toolchain?)")
    g = torch.Generator().manual_seed(0)
    lens_list = sorted(torch.randint(args.min_ctx, args.max_ctx + 1, (args.rows,), generator=g).tolist(), reverse=True)
    lens = torch.tensor(lens_list, dtype=torch.int32)
    tables, pool = engine_tables(lens_list, g)
    q = torch.randn(args.rows, HEADS, HEAD_DIM, generator=g)
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    caches = {
        name: [torch.randn(2, pool, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtypes[name]) for _ in range(LAYERS)]
        for name in args.dtypes.split(",")
    }
    probe = torch.ones(1 << 28)  # 1 GiB of float32
    tokens = sum(lens_list)
    print(f"{args.rows} rows, {tokens} tokens of context, {LAYERS} layers, {args.threads} threads")
    print(f"{'round':>5} {'cache':>9} {'ms/step':>8} {'cpu ms':>8} {'GB/s':>6} {'probe GB/s':>10} {'of probe':>8}")
    rows = []
    for r in range(args.rounds):
        for name, layer_caches in caches.items():
            best = cpu = float("inf")
            for _ in range(args.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                for cache in layer_caches:
                    cpu_kernels.paged_decode_attention(q, cache, tables, lens, scale, out=out)
                best = min(best, time.perf_counter() - t0)
                cpu = min(cpu, (time.process_time() - c0) / args.threads)
            probe_gbs = read_bandwidth_gbs(probe)
            kv_bytes = tokens * 2 * KV_HEADS * HEAD_DIM * layer_caches[0].element_size() * LAYERS
            gbs = kv_bytes / best / 1e9
            print(
                f"{r:>5} {name:>9} {best * 1e3:>8.2f} {cpu * 1e3:>8.2f} {gbs:>6.1f} {probe_gbs:>10.1f} "
                f"{gbs / probe_gbs:>8.2f}"
            )
            rows.append(
                {"round": r, "cache": name, "ms": best * 1e3, "cpu_ms": cpu * 1e3, "gb_s": gbs, "probe_gb_s": probe_gbs}
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "tag": args.tag, "threads": args.threads}
        f.write(json.dumps({**record, "rows": args.rows, "tokens": tokens, "results": rows}) + "\n")


if __name__ == "__main__":
    main()
