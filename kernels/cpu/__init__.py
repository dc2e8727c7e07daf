"""Native CPU kernels (C++), compiled by torch's extension builder at first use and cached on disk.

The ops register under `torch.ops.pagoda_cpu`. Where no C++ compiler works, `available()` says so (logged once)
and callers keep their batched-torch path.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",
        "store_kv.cpp",
        "prefill_attention.cpp",
        "fused_ops.cpp",
        "panel_linear.cpp",
        "coded_linear.cpp",
        "coded_a8_linear.cpp",
        "int8_ops.cpp",
        "bf16_linear.cpp",
        "decode_step.cpp",
        "decode_int8.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "ops.h",
        "int8_a16.h",
        "decode_attention_simd.h",
        "decode_attention_bf16.h",
        "prefill_f32.h",
        "prefill_bf16.h",
    )
]
_NAME = "pagoda_cpu_kernels"
_lock = threading.Lock()
_loaded: bool | None = None


def _build_dir() -> Path:
    """One directory per (sources, torch, CPU features): `-march=native` binaries must not travel between CPUs."""
    h = hashlib.sha256(torch.__version__.encode())
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    h.update(flags.encode())
    # NOTE: the same rule as engine_core.config.default_cache_dir (a test holds them equal): kernels sit below
    # engine_core and cannot import it, and the frontend, which needs the cache dir, must not import kernels.
    root = Path(os.path.expanduser(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda")))
    return root / "kernels" / h.hexdigest()[:16]


def available() -> bool:
    """Builds (first time on this machine, ~20 s) and loads the kernels; False where that is impossible."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if os.environ.get("PAGODA_DISABLE_CPU_KERNELS") == "1":
        return False
    from torch.utils.cpp_extension import load

    build_dir = _build_dir()
    prebuilt = build_dir / f"{_NAME}.so"
    # NOTE: torch's builder holds `lock` in the build directory while it compiles and links, and the linker writes
    # the library in place: a process that starts meanwhile (another test worker, a tensor-parallel rank) must wait
    # in `load` rather than dlopen a half-written file.
    if prebuilt.is_file() and not (build_dir / "lock").exists():
        # NOTE: the build directory is keyed by sources, torch and CPU flags, so a library there is current. Loading it
        # directly, not through the JIT builder, needs no compiler and writes nothing (the builder rewrites
        # build.ninja and takes a lock file on every load): containers run with the kernels baked into a read-only
        # PAGODA_CACHE.
        try:
            torch.ops.load_library(str(prebuilt))
            return True
        except Exception as e:
            log.warning("prebuilt native CPU kernels failed to load; rebuilding", error=str(e)[:500])
    if not any(build_dir.glob("*.so")):
        log.info("compiling native CPU kernels (once per machine, ~30 s)", build_dir=str(build_dir))
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp", "-lmvec"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, a sandbox without /tmp: keep serving with torch ops
        log.warning("native CPU kernels unavailable; using batched torch attention", error=str(e)[:500])
        return False
    return True


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] float32, rows may be strided (a view into the qkv projection)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D] float32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.pagoda_cpu.paged_decode_attention(out, q, kv_cache, block_tables, seq_lens, scale)
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] float32, rows may be strided (a view into the qkv projection)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, H_kv, D] float32, the chunks' own K/V already stored
    block_tables: torch.Tensor,  # [C, max_blocks] int32
    seq_lens: torch.Tensor,  # [C] int32, context length after each chunk
    query_start_loc: torch.Tensor,  # [C + 1] int32, chunk c's queries are rows start[c]:start[c + 1] of q
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each prefill chunk's queries (the last `qlen` positions of its context) over the paged
    cache; rows of q outside every chunk are left untouched in `out`."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.pagoda_cpu.paged_prefill_attention(out, q, kv_cache, block_tables, seq_lens, query_start_loc, scale)
    return out


def prefill_bf16_dot_products() -> bool:
    """Whether prefill attention over a bf16 cache (even head_dim) runs AVX-512 BF16 dot products (q and the softmax
    weights rounded to bf16) rather than the float32 kernel over the widened values."""
    return bool(torch.ops.pagoda_cpu.prefill_bf16_dot_products())


def decode_bf16_dot_products(head_dim: int) -> bool:
    """Whether decode attention over a bf16 cache at this head_dim runs AVX-512 BF16 dot products (q and the softmax
    weights rounded to bf16) rather than the float32 kernel over the widened values."""
    return bool(torch.ops.pagoda_cpu.decode_bf16_dot_products(head_dim))


def store_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes each token's K/V `[T, H_kv, D]` at its slot (block * block_size + offset); slot -1 is skipped."""
    torch.ops.pagoda_cpu.store_kv(kv_cache, k, v, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[:, :I]) * x[:, I:]` for x `[T, 2I]` float32 or bf16 (the output in x's dtype, fp32 arithmetic)."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    torch.ops.pagoda_cpu.silu_and_mul(out, x)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += x` (if given), then `x = rms_norm(residual or x) * weight`."""
    torch.ops.pagoda_cpu.add_rms_norm(x, residual, weight, eps)


def rms_norm_to(
    out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> None:
    """`out = rms_norm(residual += x, or x) * weight`; x and out float32 or bf16 (fp32 arithmetic), residual fp32."""
    torch.ops.pagoda_cpu.rms_norm_to(out, x, residual, weight, eps)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """In place, rotate-half form, on the first `num_heads` heads of each row of x `[T, >= num_heads * head_dim]`;
    cos/sin `[T, head_dim]` are the rows for each token's position."""
    torch.ops.pagoda_cpu.rotary_embedding(x, cos, sin, num_heads, head_dim)


def rotary_embedding_to(
    out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """`out` = bf16 `x` widened to float32, its first `num_heads` heads rotated (as `rotary_embedding`)."""
    torch.ops.pagoda_cpu.rotary_embedding_to(out, x, cos, sin, num_heads, head_dim)


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """W `[N, K]` float32 -> column panels `[ceil(N/16), K, 16]` (zero-padded) for `panel_linear`; once, at load."""
    return torch.ops.pagoda_cpu.panel_pack(weight)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` (rows may be strided) with W `[n, K]` packed by `panel_pack`."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    torch.ops.pagoda_cpu.panel_linear(out, x, packed, bias)
    return out


def bf16_linear_native() -> bool:
    """Whether `bf16_linear` runs here (a build with AVX-512 BF16; without it the op refuses)."""
    return bool(torch.ops.pagoda_cpu.bf16_linear_native())


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """W `[N, K]` bf16 -> pair panels `[ceil(N/32), ceil(K/2), 32, 2]` (zero-padded) for `bf16_linear`; at load."""
    return torch.ops.pagoda_cpu.bf16_pack(weight)


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """`x @ W.T + bias` for bf16 x `[M, K]` (rows may be strided) and W `[n, K]` packed by `bf16_pack`, fp32
    accumulation, the product as `out_dtype` (float32 or bf16, rounded to nearest even)."""
    out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    torch.ops.pagoda_cpu.bf16_linear(out, x, packed, bias)
    return out


def coded_linear_vectorized() -> bool:
    """Whether `coded_linear` has its AVX-512 or AVX2 + FMA kernel here (the portable one is exact but slower than
    float32)."""
    return bool(torch.ops.pagoda_cpu.coded_linear_vectorized())


def coded_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """W `[N, K]` float32 -> `coded_linear`'s records if W is exactly GGUF Q4_1 or Q8_0 blocks decoded (the default
    model's weights are), else None; once, at load (kernels/cpu/coded_linear.cpp)."""
    return torch.ops.pagoda_cpu.coded_pack(weight)


def coded_linear(x: torch.Tensor, records: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` (rows may be strided) with W `[n, K]` as `coded_pack`'s records, or the
    K-quants' records (`[P, K/32, 384 | 640]`, or `[P, K/32, 2, 384]` for 16-k groups: engine_core's block_codes)."""
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    torch.ops.pagoda_cpu.coded_linear(out, x, records, bias)
    return out


CODED_A8_RECORD = 384  # bytes of a 4-bit record (coded_linear.cpp): d[16], m[16] float32, 256 bytes of codes


def coded_a8_supported() -> bool:
    """Whether `coded_a8_linear` runs here (AVX2 + FMA builds)."""
    return bool(torch.ops.pagoda_cpu.coded_a8_supported())


def coded_a8_reads(records: torch.Tensor) -> bool:
    """Whether `coded_a8_linear` reads these `coded_pack` records: 4-bit ones (Q4_0, Q4_1, Q4_K)."""
    return records.dim() == 3 and records.shape[2] == CODED_A8_RECORD


def coded_a8_linear(x: torch.Tensor, records: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` approximately, W `[n, K]` as 4-bit `coded_pack` records (Q4_0 / Q4_1 / Q4_K) and x quantized
    to int8 per 32-k block, in integer dot products (kernels/cpu/coded_a8_linear.cpp)."""
    out = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    torch.ops.pagoda_cpu.coded_a8_linear(out, x, records, bias)
    return out


def int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, w8a8_m: int
) -> torch.Tensor:
    """`x @ (codes * scale[:, None]).T + bias` for float32 x `[M, K]` (rows may be strided), int8 codes `[N, K]` and
    float32 scales `[N]`: weight-only below `w8a8_m` rows, W8A8 from there (kernels/cpu/int8_ops.cpp)."""
    out = torch.empty((x.shape[0], codes.shape[0]), dtype=torch.float32, device=x.device)
    torch.ops.pagoda_cpu.int8_linear(out, x, codes, scale, bias, w8a8_m)
    return out


def int8_linear_vectorized() -> bool:
    """Whether `int8_linear` has its AVX-512 passes here (the portable ones are exact but slow)."""
    return bool(torch.ops.pagoda_cpu.int8_linear_vectorized())


def int8_weight_only_vnni() -> bool:
    """Whether `int8_linear`'s weight-only rows run on VNNI dot products, x quantized per row to 16 bits and summed
    exactly in integers (else float32 x and FMAs: kernels/cpu/int8_ops.cpp)."""
    return bool(torch.ops.pagoda_cpu.int8_weight_only_vnni())


@dataclass
class DecodeLayerWeights:
    """What `decode_layers` needs of a Llama-family model, flattened once at load."""

    norms: list[torch.Tensor]  # input and post-attention RMSNorm weights, 2 per layer
    # The qkv, o, gate_up and down projections, 4 per layer, each in the forms its dispatch reads (None: a form no
    # row count reaches): plain [out, in] float32, `panel_pack` panels, `coded_pack` records, oneDNN packed.
    out_features: list[int]
    plain: list[torch.Tensor | None]
    panels: list[torch.Tensor | None]
    coded: list[torch.Tensor | None]
    onednn: list[torch.Tensor | None]
    int8_codes: list[torch.Tensor | None]  # int8 weights (model/layers/cpu_int8.py): codes [out, in] int8 ...
    int8_scales: list[torch.Tensor | None]  # ... and float32 scales [out]; such a projection has no other form
    qkv_biases: list[torch.Tensor]  # one per layer (Qwen2), or empty
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    # GEMM row thresholds, as model/layers/cpu_forms.py dispatches: below coded_m the coded kernel (where the weight
    # has codes), below onednn_m the panel kernel, from onednn_m oneDNN, from large_m MKL
    coded_m: int
    onednn_m: int
    large_m: int
    w8a8_m: int  # int8 weights: weight-only below, W8A8 from here
    a8_m: int  # 4-bit codes: `coded_a8_linear` from here (quantization="gguf_a8"), `coded_linear` below


def decode_layers(
    h: torch.Tensor,  # [B, hidden] embeddings of the step's tokens
    cos: torch.Tensor,  # [B, head_dim] rows for each token's position
    sin: torch.Tensor,
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layers: DecodeLayerWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All decoder layers of a decode-only step in one call; returns (h, residual) before the final norm."""
    return torch.ops.pagoda_cpu.decode_layers(
        h,
        cos,
        sin,
        kv_caches,
        slot_mapping,
        block_tables,
        seq_lens,
        layers.norms,
        layers.out_features,
        layers.plain,
        layers.panels,
        layers.coded,
        layers.onednn,
        layers.int8_codes,
        layers.int8_scales,
        layers.qkv_biases,
        layers.num_heads,
        layers.num_kv_heads,
        layers.head_dim,
        layers.eps,
        layers.scale,
        layers.coded_m,
        layers.onednn_m,
        layers.large_m,
        layers.w8a8_m,
        layers.a8_m,
    )


def decode_int8_supported(max_k: int) -> bool:
    """Whether `decode_int8_head` (and decode_layers' int8 path) runs here: an AVX-512 VNNI build, every in_features
    below the 16-bit activations' limit."""
    return bool(torch.ops.pagoda_cpu.decode_int8_supported(max_k))


@dataclass
class Int8Head:
    """The LM head after an all-int8 model's layers (`decode_int8_head`): the final norm's weight, the head's codes
    `[vocab, hidden]` int8 and scales `[vocab]` float32."""

    final_norm: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor


def decode_int8_head(
    input_ids: torch.Tensor,  # [B] the step's tokens
    positions: torch.Tensor,  # [B]
    embedding: torch.Tensor,  # [vocab, hidden] float32, or int8 codes with embedding_scale: the rows of input_ids
    embedding_scale: torch.Tensor | None,  # [vocab] float32 per-row scales of int8 codes (row r = codes[r] * scale[r])
    cos_table: torch.Tensor,  # [max_positions, head_dim] float32: the rows of positions
    sin_table: torch.Tensor,
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layers: DecodeLayerWeights,
    head: Int8Head,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_layers` for int8 weight-only layers (every projection's `int8_codes` set), from the embedding and
    rotary rows (gathered in the call), then the final norm and the LM head in the same parallel region
    (kernels/cpu/decode_int8.cpp). Returns (logits [B, vocab], an empty tensor), or with `greedy` (each row's largest
    logit [B], NaN where any logit is NaN; its first index [B] int64, -1 where that maximum is not finite: the
    sampler's FAILED_TOKEN)."""
    return torch.ops.pagoda_cpu.decode_int8_head(
        input_ids,
        positions,
        embedding,
        embedding_scale,
        cos_table,
        sin_table,
        kv_caches,
        slot_mapping,
        block_tables,
        seq_lens,
        layers.norms,
        [*layers.int8_codes, head.codes],
        [*layers.int8_scales, head.scale],
        layers.qkv_biases,
        head.final_norm,
        layers.num_heads,
        layers.num_kv_heads,
        layers.head_dim,
        layers.eps,
        layers.scale,
        greedy,
    )
