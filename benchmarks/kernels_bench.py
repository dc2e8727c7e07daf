"""GPU microbenchmark of the paged attention kernels against torch SDPA on contiguous K/V.

Decode: batch 1/32/256 x context 512/2048/8192 at the attention shapes of `--shapes` (default Llama-3-8B: 32 query
heads, 8 KV heads, head dim 128; `smollm2`: 9 / 3 / 64), bf16, block size 16, shuffled block tables. Reports time,
achieved HBM bandwidth (K/V bytes read, which dominate) and its fraction of the HBM peak, the split count the
heuristic picked, the time without splitting, and torch SDPA (flash, GQA) on the same K/V stored contiguously.
Prefill: causal TFLOP/s for fresh prefills and for extends over cached context, versus SDPA.

    python benchmarks/kernels_bench.py [--shapes llama8b,smollm2] [--hbm-peak-gbs 3350] [--json out.json]

`benchmarks/gpu_check.py` runs it at both shapes as part of `make gpu-check`.

`triton.testing.do_bench` flushes L2 between repetitions, so small contexts are measured from HBM too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Run as a script from a checkout: make `kernels` importable even without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class AttnShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = {
    "llama8b": AttnShape(32, 8, 128),  # Llama-3-8B
    "smollm2": AttnShape(9, 3, 64),  # SmolLM2-135M
}
# HBM peak by device name (GB/s, vendor figures): the denominator of "% of peak".
HBM_PEAK_GBS = {"H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 32, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
# (sequences, cached context before the chunk, chunk length)
PREFILL_CASES = ((1, 0, 2048), (4, 0, 1024), (1, 0, 8192), (8, 2048, 512), (2, 8192, 1024))


def _paged_from_contiguous(
    k: torch.Tensor, v: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy contiguous `[B, KVH, L, D]` K/V into a paged cache with shuffled blocks. Returns (k_cache, v_cache,
    block_tables)."""
    batch, kv_heads, length, dim = k.shape
    blocks_per_seq = -(-length // block_size)
    padded = blocks_per_seq * block_size
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device=k.device)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    caches = []
    for src in (k, v):
        cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=src.dtype, device=src.device)
        staged = torch.zeros(batch, padded, kv_heads, dim, dtype=src.dtype, device=src.device)
        staged[:, :length] = src.transpose(1, 2)
        cache[perm] = staged.view(num_blocks, block_size, kv_heads, dim)
        del staged
        caches.append(cache)
    return caches[0], caches[1], tables


def hbm_peak_gbs(device_name: str) -> float:
    """The vendor HBM peak for a device name (first matching key; H100 SXM if unknown)."""
    return next((gbs for key, gbs in HBM_PEAK_GBS.items() if key in device_name), HBM_PEAK_GBS["H100"])


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds. On CPU (gpu_check's --dry-run, interpreter) one timed call: proves the wiring only."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))  # ms, median


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    if err > 5e-2:
        sys.exit(f"{name}: triton and SDPA disagree (max abs error {err:.3e}); not benchmarking a wrong kernel")


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def _decode_case(
    shape: AttnShape, batch: int, ctx: int, block_size: int, peak_gbs: float, device: str
) -> dict[str, float]:
    from kernels.triton import choose_num_splits, decode_attention

    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = shape.num_heads, shape.num_kv_heads, shape.head_dim
    scale = HEAD_DIM**-0.5
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(batch, NUM_KV_HEADS, ctx, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    k_cache, v_cache, tables = _paged_from_contiguous(k, v, block_size)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, NUM_KV_HEADS, ctx, _num_sms())

    def triton_fn(num_splits: int | None = None) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, tables, lens, scale, ctx, out=out, num_splits=num_splits)

    def sdpa_fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    _check(f"decode b{batch} ctx{ctx}", triton_fn(), sdpa_fn().squeeze(2))
    t_triton = _bench(triton_fn)
    t_nosplit = _bench(lambda: triton_fn(1)) if splits > 1 else t_triton
    t_sdpa = _bench(sdpa_fn)
    # K and V reads dominate; q, out and block tables are < 1% of the bytes at these shapes.
    nbytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * k.element_size()
    gbs = nbytes / t_triton / 1e6
    return {
        "batch": batch,
        "ctx": ctx,
        "splits": splits,
        "triton_ms": t_triton,
        "triton_gbs": gbs,
        "pct_peak": 100 * gbs / peak_gbs,
        "nosplit_ms": t_nosplit,
        "sdpa_ms": t_sdpa,
        "sdpa_gbs": nbytes / t_sdpa / 1e6,
    }


def bench_decode(
    shape: AttnShape,
    block_size: int,
    peak_gbs: float,
    batches: tuple[int, ...] = DECODE_BATCHES,
    contexts: tuple[int, ...] = DECODE_CONTEXTS,
    device: str = "cuda",
) -> list[dict[str, float]]:
    print(
        f"\n== decode: {shape.num_heads} q heads / {shape.num_kv_heads} kv heads, head dim {shape.head_dim}, bf16, "
        f"block {block_size}"
    )
    print(
        f"{'batch':>6} {'ctx':>6} {'splits':>6} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} "
        f"{'no-split ms':>11} {'sdpa ms':>9} {'sdpa GB/s':>10}"
    )
    rows = []
    for batch in batches:
        for ctx in contexts:
            r = _decode_case(shape, batch, ctx, block_size, peak_gbs, device)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rows.append(r)
            print(
                f"{batch:>6} {ctx:>6} {r['splits']:>6} {r['triton_ms']:>10.4f} {r['triton_gbs']:>8.0f} "
                f"{r['pct_peak']:>6.1f}% {r['nosplit_ms']:>11.4f} {r['sdpa_ms']:>9.4f} {r['sdpa_gbs']:>10.0f}"
            )
    return rows


def _prefill_case(
    shape: AttnShape, seqs: int, ctx: int, qlen: int, block_size: int, device: str, tile: tuple[int, int, int] | None
) -> dict[str, float]:
    from kernels.triton import prefill_attention

    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = shape.num_heads, shape.num_kv_heads, shape.head_dim
    scale = HEAD_DIM**-0.5
    total = ctx + qlen
    q = torch.randn(seqs, NUM_HEADS, qlen, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(seqs, NUM_KV_HEADS, total, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    k_cache, v_cache, tables = _paged_from_contiguous(k, v, block_size)
    q_flat = q.transpose(1, 2).reshape(seqs * qlen, NUM_HEADS, HEAD_DIM).contiguous()
    starts = torch.arange(0, (seqs + 1) * qlen, qlen, dtype=torch.int32, device=device)
    lens = torch.full((seqs,), total, dtype=torch.int32, device=device)
    out = torch.empty_like(q_flat)
    # SDPA's is_causal is top-left aligned: right only without context. With context it needs an explicit
    # (bottom-right aligned) mask, which flash does not take: give the mem-efficient kernel K/V expanded to all query
    # heads (outside the timed region) instead of enable_gqa, which it does not take either.
    mask = None
    k_sdpa, v_sdpa = k, v
    if ctx > 0:
        mask = torch.arange(total, device=device)[None, :] <= torch.arange(ctx, total, device=device)[:, None]
        group = NUM_HEADS // NUM_KV_HEADS
        k_sdpa, v_sdpa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def triton_fn() -> torch.Tensor:
        block_m, block_n, warps = tile or (None, None, None)
        return prefill_attention(
            q_flat, k_cache, v_cache, tables, lens, starts, scale, qlen, out, block_m, block_n, warps
        )

    def sdpa_fn() -> torch.Tensor:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k_sdpa, v_sdpa, attn_mask=mask, scale=scale)

    expected = sdpa_fn().transpose(1, 2).reshape(seqs * qlen, NUM_HEADS, HEAD_DIM)
    _check(f"prefill {seqs}x(ctx {ctx} + {qlen})", triton_fn(), expected)
    t_triton, t_sdpa = _bench(triton_fn), _bench(sdpa_fn)
    # Useful work only: the query at absolute position p attends p + 1 keys; 2 matmuls x 2 FLOP per MAC.
    pairs = seqs * sum(p + 1 for p in range(ctx, total))
    flops = 4 * pairs * HEAD_DIM * NUM_HEADS
    return {
        "seqs": seqs,
        "ctx": ctx,
        "chunk": qlen,
        "triton_ms": t_triton,
        "triton_tflops": flops / t_triton / 1e9,
        "sdpa_ms": t_sdpa,
        "sdpa_tflops": flops / t_sdpa / 1e9,
    }


def bench_prefill(
    shape: AttnShape,
    block_size: int,
    cases: tuple[tuple[int, int, int], ...] = PREFILL_CASES,
    device: str = "cuda",
    tile: tuple[int, int, int] | None = None,
) -> list[dict[str, float]]:
    """`tile`: (block_m, block_n, num_warps) of the Triton kernel; None = its defaults."""
    print(
        f"\n== prefill (causal): {shape.num_heads} q heads / {shape.num_kv_heads} kv heads, "
        f"head dim {shape.head_dim}, bf16" + (f", tile {tile}" if tile else "")
    )
    print(f"{'seqs':>5} {'ctx':>6} {'chunk':>6} {'triton ms':>10} {'TFLOP/s':>8} {'sdpa ms':>9} {'sdpa TFLOP/s':>12}")
    rows = []
    for seqs, ctx, qlen in cases:
        r = _prefill_case(shape, seqs, ctx, qlen, block_size, device, tile)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rows.append(r)
        print(
            f"{seqs:>5} {ctx:>6} {qlen:>6} {r['triton_ms']:>10.4f} {r['triton_tflops']:>8.1f} "
            f"{r['sdpa_ms']:>9.4f} {r['sdpa_tflops']:>12.1f}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama8b", help=f"comma list of {sorted(SHAPES)}")
    parser.add_argument("--hbm-peak-gbs", type=float, default=None, help="HBM peak in GB/s; default by device name")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--prefill-tiles",
        default="",
        help="also sweep the prefill kernel over these BLOCK_MxBLOCK_NxWARPS tiles, e.g. 64x64x4,128x64x8",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU: no CUDA device is visible (the CPU interpreter is far too slow).")

    torch.manual_seed(0)
    name = torch.cuda.get_device_name(0)
    peak = args.hbm_peak_gbs or hbm_peak_gbs(name)
    print(f"device: {name}, HBM peak assumed {peak:.0f} GB/s")
    results: dict[str, object] = {"device": name, "hbm_peak_gbs": peak}
    for key in args.shapes.split(","):
        shape = SHAPES[key]
        results[key] = {
            "shape": vars(shape),
            "decode": bench_decode(shape, args.block_size, peak),
            "prefill": bench_prefill(shape, args.block_size),
        }
        for spec in filter(None, args.prefill_tiles.split(",")):
            m, n, w = (int(x) for x in spec.split("x"))
            results[key][f"prefill_{spec}"] = bench_prefill(shape, args.block_size, tile=(m, n, w))  # type: ignore[index]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
