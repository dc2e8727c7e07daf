"""CPU microbenchmarks behind the CPU fast path's design choices (float32, SmolLM2-135M shapes, random weights).

- `gemm`: the 30 layers' projections (576x960 qkv, 576x576 o, 576x3072 gate/up, 1536x576 down) and the
  49152x576 LM head at 1..2048 rows, through MKL `F.linear`, oneDNN with the weight packed once
  (`mkldnn._linear_pointwise`), the native
  panel kernel (`panel_linear`, weight packed once into 16-column panels, meant for decode-sized row counts) and,
  up to 64 rows, the coded kernel (`coded_linear`: the same weights read as GGUF blocks, Q4_1 for the layers and
  Q8_0 for the LM head as in the default model; every kernel runs the same random weights, which are such blocks),
  the layers' 4-bit codes with 8-bit activations (`a8`: `coded_a8_linear`, quantization="gguf_a8", AVX2 + FMA),
  bf16 oneDNN (as `dtype="bfloat16"` runs it) and the two int8 kernels of `quantization="int8"` on the same weights
  quantized per channel (`w8`: weight-only, activations in 16 bits per token on VNNI, float32 without it; `w8a8`:
  int8 activations with per-token scales, VNNI; both kernels/cpu/int8_ops.cpp; `w8r`: the same codes as the coded
  kernel's 8-bit records, as int8 runs on a CPU without int8 dot products, model/layers/cpu_int8_records.py);
  then the coded kernel on the K-quants' record layouts (Q4_K: 4-bit, Q5_K: 8-bit, Q6_K: two 16-k halves) of
  random valid blocks of the same shapes (`--kquants`).
- `attention`: decode attention per layer (9 query / 3 KV heads, head dim 64, block size 16, context lengths
  uniform in [ctx/4, ctx] sorted longest-first as the engine hands them over, one cache per layer so the K/V come
  from DRAM; block tables in allocation order, shuffled, and with 4 shared prefixes): the torch backend (gather into
  a workspace + SDPA, in length groups) against the native paged kernel, over a float32 cache and over a bf16 one
  (kv_cache_dtype="bfloat16": half the bytes). Its GB/s count every row's K/V, so a shared prefix read once from
  DRAM shows as more than DRAM gives.
- `prefill`: one layer of prefill attention (same heads, shuffled block tables): gather + SDPA per chunk (the
  `torch` backend's `TorchPrefill`) against the native paged prefill kernel, in causal GFLOP/s (4 * D * H flops
  per visible (query, key) pair), over a float32 cache and over the same values in a bf16 one (AVX-512 BF16 dot
  products where the CPU has them; the two native arms alternated, best of 3 medians each).

    python benchmarks/cpu_bench.py [gemm|attention|prefill|all] [--threads 2] [--rows 1 8 64]

Appends one JSON line per run to benchmarks/results/cpu_bench.jsonl. Numbers from a quiet machine only: another
busy process on a 2-core box halves them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results" / "cpu_bench.jsonl"
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
LAYERS = 30
VOCAB = 49152
ROWS = [1, 2, 4, 5, 8, 16, 32, 64, 128, 256, 512, 2048]


def timed(fn: Callable[[], object], min_seconds: float = 0.5) -> float:
    """Median of repeated calls after a warm-up, in ms."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 3:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def _kquant_records(kind_name: str, out: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Records of random valid `kind_name` blocks for `[out, k]` (k padded to super-blocks of 256, then cut)."""
    from gguf import GGMLQuantizationType

    from engine_core.model.gguf_kquants import KQUANTS, unpack_kquant
    from engine_core.model.layers.block_codes import BlockCodes

    kind = GGMLQuantizationType[kind_name]
    padded = -(-k // 256) * 256
    raw = torch.randint(0, 256, (out * padded // 256, KQUANTS[kind]), dtype=torch.uint8, generator=g)
    scale = (torch.randn(raw.shape[0], generator=g) * 1e-3).half().view(torch.uint8).view(-1, 2)
    if kind == GGMLQuantizationType.Q6_K:
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    c = unpack_kquant(kind, raw.reshape(-1), (out, padded))
    offsets = None if c.offsets is None else c.offsets[:, : k // c.group].contiguous()
    return BlockCodes(
        c.scales[:, : k // c.group].contiguous(), offsets, c.q[:, :k].contiguous(), c.group, c.bits
    ).records()


def _coded_layers(records: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    from kernels import cpu as cpu_kernels

    for rs in records:
        for (i, o), r in zip(LAYER_SHAPES, rs, strict=True):
            cpu_kernels.coded_linear(xs[i], r, o, None)


def bench_kquants(rows: list[int]) -> list[dict[str, object]]:
    """The 30 layers through the coded kernel per record layout: Q4_1 (the default model's), Q4_K, Q5_K, Q6_K."""
    from kernels import cpu as cpu_kernels
    from kernels.reference import ref_gguf_decoded

    g = torch.Generator().manual_seed(0)
    weights = {
        "q4_1": [
            [cpu_kernels.coded_pack(ref_gguf_decoded(torch.randn(o, i) * 0.02, "q4_1")) for i, o in LAYER_SHAPES]
            for _ in range(LAYERS)
        ]
    }
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        weights[kind] = [[_kquant_records(kind, o, i, g) for i, o in LAYER_SHAPES] for _ in range(LAYERS)]
    print("rows | 30 layers, coded kernel: " + ", ".join(weights) + "   (ms)")
    out: list[dict[str, object]] = []
    for m in rows:
        xs = {i: torch.randn(m, i) for i, _ in LAYER_SHAPES}
        row: dict[str, object] = {"rows": m}

        with torch.inference_mode():
            for name, records in weights.items():
                row[f"layers_{name.lower()}_ms"] = timed(partial(_coded_layers, records, xs))
        print(f"{m:>5} " + " ".join(f"{row[k]:>9.2f}" for k in row if k != "rows"), flush=True)
        out.append(row)
    return out


def bench_gemm(rows: list[int]) -> list[dict[str, object]]:
    from engine_core.model.layers.cpu_bfloat16 import cpu_bf16_gemms, this_cpu_flags
    from engine_core.model.layers.cpu_int8 import int8_dot_products
    from engine_core.model.layers.cpu_int8_records import int8_records
    from engine_core.model.layers.int8_gemm import Int8Weight, int8_gemm, quantize_per_channel
    from kernels import cpu as cpu_kernels
    from kernels.reference import ref_gguf_decoded

    # NOTE: the bf16 and int8 columns need their instructions (oneDNN refuses bf16 weights without AVX-512 or
    # AVX-NE-CONVERT; int8 runs int8_ops.cpp only with int8 dot products, the records elsewhere): where the CPU
    # lacks them they print "-".
    has_bf16 = cpu_bf16_gemms()  # the engine's own check for dtype="bfloat16"
    has_int8 = int8_dot_products(this_cpu_flags())
    has_records = cpu_kernels.coded_linear_vectorized()
    has_a8 = cpu_kernels.coded_a8_supported()  # quantization="gguf_a8": AVX2 + FMA builds
    torch.manual_seed(0)
    # NOTE: GGUF-decoded random weights (Q4_1 layers, Q8_0 LM head, as the default model's), so that every kernel,
    # the coded one included, runs the same values
    plain = [[ref_gguf_decoded(torch.randn(o, i) * 0.02, "q4_1") for i, o in LAYER_SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws] for ws in plain]
    lm = ref_gguf_decoded(torch.randn(VOCAB, 576) * 0.02, "q8_0")
    lm_packed = torch.ops.mkldnn._reorder_linear_weight(lm, None)
    if has_bf16:
        bf16 = [[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) for w in ws] for ws in plain]
        lm_bf16 = torch.ops.mkldnn._reorder_linear_weight(lm.bfloat16(), None)

    def int8(w: torch.Tensor, w8a8_m: int) -> Int8Weight:
        codes, scale = quantize_per_channel(w)
        return Int8Weight(codes, scale, w8a8_m)

    never = 1 << 62
    if has_int8:
        w8 = [[int8(w, never) for w in ws] for ws in plain]
        w8a8 = [[Int8Weight(q.codes, q.scale, 0) for q in ws] for ws in w8]
        lm_w8, lm_w8a8 = int8(lm, never), int8(lm, 0)
    if has_records:
        w8r = [[(int8_records(*quantize_per_channel(w)), w.shape[0]) for w in ws] for ws in plain]
        lm_w8r = (int8_records(*quantize_per_channel(lm)), VOCAB)
    panels = [[(cpu_kernels.panel_pack(w), w.shape[0]) for w in ws] for ws in plain]
    lm_panels = (cpu_kernels.panel_pack(lm), VOCAB)
    coded = [[(cpu_kernels.coded_pack(w), w.shape[0]) for w in ws] for ws in plain]
    lm_coded = (cpu_kernels.coded_pack(lm), VOCAB)
    rows_out: list[dict[str, object]] = []
    print(
        "rows | 30 layers: mkl, onednn, panel, coded, a8, bf16, w8, w8a8, w8r | lm head: mkl, onednn, panel, coded, "
        "bf16, w8, w8a8, w8r   (ms)"
    )
    mkl = torch.nn.functional.linear

    def dnn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def dnn_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """As dtype="bfloat16" runs it (cpu_forms.cpu_gemm): x cast to bf16, the product back to float32."""
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), w, None, "none", [], "").float()

    def int8_op(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        return int8_gemm(w, x, None)

    def panel(x: torch.Tensor, w: tuple[torch.Tensor, int]) -> torch.Tensor:
        return cpu_kernels.panel_linear(x, w[0], w[1], None)

    def coded_op(x: torch.Tensor, w: tuple[torch.Tensor, int]) -> torch.Tensor:
        return cpu_kernels.coded_linear(x, w[0], w[1], None)

    def a8_op(x: torch.Tensor, w: tuple[torch.Tensor, int]) -> torch.Tensor:
        return cpu_kernels.coded_a8_linear(x, w[0], w[1], None)

    def layers(op: Callable[..., object], weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
        for ws in weights:
            for (i, _), w in zip(LAYER_SHAPES, ws, strict=True):
                op(xs[i], w)

    for m in rows:
        xs = {i: torch.randn(m, i) for i, _ in LAYER_SHAPES}
        x = xs[576]
        row: dict[str, object] = {"rows": m}
        with torch.inference_mode():
            row["layers_mkl_ms"] = timed(partial(layers, mkl, plain, xs))
            row["layers_onednn_ms"] = timed(partial(layers, dnn, packed, xs))
            row["layers_panel_ms"] = timed(partial(layers, panel, panels, xs))
            row["layers_coded_ms"] = timed(partial(layers, coded_op, coded, xs))
            row["layers_a8_ms"] = timed(partial(layers, a8_op, coded, xs)) if has_a8 else None
            row["layers_bf16_ms"] = timed(partial(layers, dnn_bf16, bf16, xs)) if has_bf16 else None
            row["layers_w8_ms"] = timed(partial(layers, int8_op, w8, xs)) if has_int8 else None
            row["layers_w8a8_ms"] = timed(partial(layers, int8_op, w8a8, xs)) if has_int8 else None
            row["layers_w8r_ms"] = timed(partial(layers, coded_op, w8r, xs)) if has_records else None
            row["lm_mkl_ms"] = timed(partial(mkl, x, lm))
            row["lm_onednn_ms"] = timed(partial(dnn, x, lm_packed))
            row["lm_panel_ms"] = timed(partial(panel, x, lm_panels))
            row["lm_coded_ms"] = timed(partial(coded_op, x, lm_coded))
            row["lm_bf16_ms"] = timed(partial(dnn_bf16, x, lm_bf16)) if has_bf16 else None
            row["lm_w8_ms"] = timed(partial(int8_op, x, lm_w8)) if has_int8 else None
            row["lm_w8a8_ms"] = timed(partial(int8_op, x, lm_w8a8)) if has_int8 else None
            row["lm_w8r_ms"] = timed(partial(coded_op, x, lm_w8r)) if has_records else None
        cells = [row[k] for k in row if k != "rows"]
        print(f"{m:>5} " + " ".join(f"{c:>9.2f}" if c is not None else f"{'-':>9}" for c in cells), flush=True)
        rows_out.append(row)
    return rows_out


# One layer of SmolLM2-135M's attention over a paged cache of ATTN_POOL blocks (both attention benches).
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK, ATTN_POOL = 9, 3, 64, 16, 4096


def _shuffled_tables(g: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """Block tables of distinct, shuffled blocks (block 0 left out)."""
    return (torch.randperm(ATTN_POOL - 1, generator=g)[: rows * width] + 1).view(rows, width).int()


def _each_layer(caches: list[torch.Tensor], op: Callable[[torch.Tensor], object]) -> None:
    for cache in caches:
        op(cache)


def _torch_decode(ref: Any, q: torch.Tensor, meta: Any, out: torch.Tensor, cache: torch.Tensor) -> None:
    ref._decode(q, cache, meta, ref._workspace.buffer(cache), out)


def _native_decode(
    op: Callable[..., object],
    q: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    cache: torch.Tensor,
) -> None:
    op(q, cache, tables, lens, scale, out=out)


def bench_attention() -> list[dict[str, object]]:
    from engine_core.attention.backend import AttentionMetadata
    from engine_core.attention.torch_backend import TorchAttentionBackend
    from kernels import cpu as cpu_kernels

    heads, kv_heads, head_dim, bs = ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK
    scale = head_dim**-0.5
    g = torch.Generator().manual_seed(0)
    rows_out: list[dict[str, object]] = []
    print(
        f"{'batch':>5} {'ctx':>5} {'tables':>10} {'gather+sdpa ms':>15} {'native ms':>10} {'native GB/s':>12} "
        f"{'bf16 KV ms':>11}"
    )
    for batch, ctx in ((1, 200), (1, 4000), (8, 300), (32, 400), (64, 400), (64, 700), (64, 1024)):
        lens = torch.randint(ctx // 4, ctx + 1, (batch,), generator=g).sort(descending=True).values.int()
        width = -(-ctx // bs)
        pool = batch * width + 1
        # NOTE: one cache per layer, as many layers as it takes to outgrow the L3 (up to 30, SmolLM2's count): in the
        # engine every layer's K/V comes from DRAM, and one cache timed in a loop would sit in the cache hierarchy.
        layers = max(4, min(30, (256 << 20) // (2 * pool * bs * kv_heads * head_dim * 4)))
        caches = [torch.randn(2, pool, bs, kv_heads, head_dim, generator=g) for _ in range(layers)]
        caches_bf16 = [c.bfloat16() for c in caches]
        q = torch.randn(batch, heads, head_dim, generator=g)
        kv_bytes = int(lens.sum()) * 2 * kv_heads * head_dim * 4
        # Tables in allocation order (a sequence's blocks consecutive, as a fresh pool hands them out), shuffled, and
        # (from 16 rows) in allocation order with 4 shared prefixes: row i's first blocks, as many as the shortest
        # row fills, are prefix i % 4's, as the prefix cache hands them to requests with a common system prompt.
        for order in ("allocation", "shuffled", "prefixes")[: 3 if batch >= 16 else 2]:
            blocks = torch.randperm(pool - 1, generator=g) if order == "shuffled" else torch.arange(pool - 1)
            tables = (blocks[: batch * width] + 1).view(batch, width).int()
            label = order
            if order == "prefixes":
                shared = int(lens.min()) // bs
                tables[:, :shared] = tables[torch.arange(batch) % 4, :shared]
                label = f"4x{shared * bs} pre"
            meta = AttentionMetadata(
                num_decodes=batch,
                num_prefills=0,
                slot_mapping=torch.full((batch,), -1, dtype=torch.long),
                decode_seq_lens=lens,
                decode_block_tables=tables,
                max_decode_seq_len=int(lens.max()),
                prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
                prefill_seq_lens=torch.zeros(0, dtype=torch.int32),
                prefill_block_tables=torch.zeros(0, width, dtype=torch.int32),
                max_prefill_query_len=0,
                prefill_query_lens_cpu=[],
                prefill_seq_lens_cpu=[],
            )
            ref = TorchAttentionBackend(heads, kv_heads, head_dim, bs, scale)
            ref.prepare(meta)
            out = torch.empty_like(q)

            with torch.inference_mode():
                torch_ms = timed(partial(_each_layer, caches, partial(_torch_decode, ref, q, meta, out))) / layers
                native_op = partial(_native_decode, cpu_kernels.paged_decode_attention, q, tables, lens, scale, out)
                native_ms = timed(partial(_each_layer, caches, native_op)) / layers
                bf16_ms = timed(partial(_each_layer, caches_bf16, native_op)) / layers
            row = {
                "batch": batch,
                "ctx": ctx,
                "tables": label,
                "torch_ms": torch_ms,
                "native_ms": native_ms,
                "native_gb_s": kv_bytes / native_ms / 1e6,
                "native_bf16_kv_ms": bf16_ms,
            }
            print(
                f"{batch:>5} {ctx:>5} {label:>10} {torch_ms:>15.3f} {native_ms:>10.3f} {row['native_gb_s']:>12.1f} "
                f"{bf16_ms:>11.3f}",
                flush=True,
            )
            rows_out.append(row)
    return rows_out


def bench_prefill() -> list[dict[str, object]]:
    from engine_core.attention.backend import AttentionMetadata
    from engine_core.attention.torch_prefill import GatherWorkspace, TorchPrefill
    from kernels import cpu as cpu_kernels

    heads, kv_heads, head_dim, bs = ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM, ATTN_BLOCK
    scale = head_dim**-0.5
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, ATTN_POOL, bs, kv_heads, head_dim, generator=g)
    rows_out: list[dict[str, object]] = []
    print(
        f"{'case':>22} {'gather+sdpa ms':>15} {'native ms':>10} {'sdpa GFLOP/s':>13} {'native GFLOP/s':>15}"
        f" {'bf16 KV ms':>11} {'bf16 GFLOP/s':>13}"
    )
    cache_bf16 = cache.bfloat16()
    # (cached context, chunk length) per chunk: a 5-prompt prefill step; one long extend over a cached prefix.
    cases = {
        "5 x ~410, no context": [(0, 400), (0, 410), (0, 420), (0, 400), (0, 418)],
        "512 over 1536 cached": [(1536, 512)],
        "16 x 128, no context": [(0, 128)] * 16,
    }
    for name, chunks in cases.items():
        qlens = [q for _, q in chunks]
        seq_lens = [c + q for c, q in chunks]
        width = max(-(-s // bs) for s in seq_lens)
        tables = _shuffled_tables(g, len(chunks), width)
        q = torch.randn(sum(qlens), heads, head_dim, generator=g)
        starts = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            num_decodes=0,
            num_prefills=len(chunks),
            slot_mapping=torch.full((sum(qlens),), -1, dtype=torch.long),
            decode_seq_lens=torch.zeros(0, dtype=torch.int32),
            decode_block_tables=torch.zeros(0, width, dtype=torch.int32),
            max_decode_seq_len=0,
            prefill_query_start_loc=starts,
            prefill_seq_lens=lens,
            prefill_block_tables=tables,
            max_prefill_query_len=max(qlens),
            prefill_query_lens_cpu=qlens,
            prefill_seq_lens_cpu=seq_lens,
        )
        ref = TorchPrefill(kv_heads, head_dim, bs, scale)
        ws = GatherWorkspace(bs, kv_heads, head_dim)
        ws.needed_blocks = ref.prepare(meta)
        out = torch.empty_like(q)
        with torch.inference_mode():
            torch_ms = timed(partial(ref.forward, q, cache, meta, ws.buffer(cache), out))
            native = partial(cpu_kernels.paged_prefill_attention, q, cache, tables, lens, starts, scale)
            bf16 = partial(cpu_kernels.paged_prefill_attention, q, cache_bf16, tables, lens, starts, scale)
            arms = [(timed(native), timed(bf16)) for _ in range(3)]  # NOTE: alternated: the machine may be shared
            native_ms, bf16_ms = min(a for a, _ in arms), min(b for _, b in arms)
        pairs = sum(q * c + q * (q + 1) // 2 for c, q in chunks)  # visible (query, key) pairs per head
        gflop = 4 * head_dim * heads * pairs / 1e9
        row = {
            "case": name,
            "torch_ms": torch_ms,
            "native_ms": native_ms,
            "torch_gflop_s": gflop / torch_ms * 1e3,
            "native_gflop_s": gflop / native_ms * 1e3,
            "native_bf16_kv_ms": bf16_ms,
            "native_bf16_kv_gflop_s": gflop / bf16_ms * 1e3,
        }
        print(
            f"{name:>22} {torch_ms:>15.2f} {native_ms:>10.2f} {row['torch_gflop_s']:>13.1f}"
            f" {row['native_gflop_s']:>15.1f} {bf16_ms:>11.2f} {row['native_bf16_kv_gflop_s']:>13.1f}",
            flush=True,
        )
        rows_out.append(row)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="?", default="all", choices=["gemm", "attention", "prefill", "all"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS, help="gemm: the row counts (default: %(default)s)")
    ap.add_argument("--kquants", action="store_true", help="gemm: also the coded kernel on the K-quant layouts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        sys.exit("the native CPU kernels are unavailable (no C++ toolchain?)")
    record: dict[str, object] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    if args.which in ("gemm", "all"):
        record["gemm"] = bench_gemm(args.rows)
        if args.kquants:
            record["gemm_kquants"] = bench_kquants(args.rows)
    if args.which in ("attention", "all"):
        record["attention"] = bench_attention()
    if args.which in ("prefill", "all"):
        record["prefill"] = bench_prefill()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
