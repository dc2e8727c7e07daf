"""`y = x @ W.T (+ bias)` with W held as int8 codes and float32 scales (and offsets): W is decoded tile by tile into
registers, never copied whole in a float dtype.

One layout for every weight format the CUDA linears keep (engine_core/model/layers/cuda_codes.py):
- grouped (GGUF Q8_0 ... Q6_K): codes `[N, K]` int8, scales and offsets `[N, K // group]` float32 with `group` 16 or
  32; a weight is `fma(scale, q, offset)` (offsets None: `scale * q`), what `BlockCodes.values()` computes;
- per output channel (`quantization="int8"`): codes `[N, K]` int8, scales `[N]`; the sum over k runs on the codes and
  is scaled once per output (`(x @ q.T) * scale`).
The decoded tile is rounded to x's dtype for `tl.dot` (fp32 accumulation); fp32 activations use exact IEEE dots
(TF32 would part greedy tokens from float32's), as does the interpreter (`common.mma`). The output is in x's dtype.

Two regimes by row count (`plan_coded_matmul`):
- decode (M <= 16): one 16-row tile, narrow column tiles and the K range split over `split` programs, so that a
  batch-1 step spreads the weight's bytes over every SM (memory-bound: bytes of codes are the cost); the splits'
  float32 partials are summed in torch (deterministic, unlike atomics);
- prefill (M > 16): 64 x 64 tiles, one program per tile over the whole K.
4-bit codes (Q4_0, Q4_1, Q4_K) are packed two a byte (`pack_nibbles`: halves of K, not neighbours, so a byte tile
decodes into two plain tiles and two dots with no shuffle): batch 1 reads half the bytes. Compile variants: (regime,
per-channel or group 16 / 32, offsets, packed, bias, split or not, dtype) per layer shape; the row count and the
split count are runtime values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton.common import mma, use_fp32_dot

DECODE_ROWS = 16  # row counts up to this run the decode regime
_MAX_SPLIT = 8


# NOTE: the row count and the partials' stride (M * N) change with every batch size: not specialized on, so a layer's
# launches at 2 ... 16 rows (or 17 and up) share one variant, and the decode graphs' buckets compile nothing new.
CODED_DO_NOT_SPECIALIZE = ["M", "stride_os"]


@triton.jit
def _decoded(
    q,
    scale_ptr,
    offset_ptr,
    rows_n,
    mask_n,
    k_first,
    k_lim,
    stride_sn,
    GROUP: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A `[BLOCK_K, BLOCK_N]` tile of codes (k = `k_first` + 0 .. BLOCK_K - 1, a multiple of GROUP) as float32
    weights: `fma(scale, q, offset)` per group, or the codes themselves per channel (scaled after the sum).

    NOTE: the scales (and offsets) load once per group, `[BLOCK_K / GROUP, BLOCK_N]`, and broadcast over the
    group's k through a 3-d view: loading them per weight cost 8 bytes of loads per byte of codes. Groups at or past
    `k_lim` load as 0 (their codes and x are masked to 0 too)."""
    w = q.to(tl.float32)
    if GROUP > 0:
        groups = k_first // GROUP + tl.arange(0, BLOCK_K // GROUP)
        gmask = (groups[:, None] * GROUP < k_lim) & mask_n[None, :]
        at = rows_n[None, :] * stride_sn + groups[:, None]
        s = tl.load(scale_ptr + at, mask=gmask, other=0.0)
        w3 = tl.reshape(w, (BLOCK_K // GROUP, GROUP, BLOCK_N)) * s[:, None, :]
        if HAS_OFFSETS:
            w3 = w3 + tl.load(offset_ptr + at, mask=gmask, other=0.0)[:, None, :]
        w = tl.reshape(w3, (BLOCK_K, BLOCK_N))
    return w


@triton.jit(do_not_specialize=CODED_DO_NOT_SPECIALIZE)
def _coded_matmul_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    offset_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    k_cols,  # columns of codes: K, or K / 2 bytes when PACKED
    half,  # PACKED: K / 2, the k of a byte's high nibble past its low one's
    k_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_os,
    GROUP: tl.constexpr,  # 0: per output channel; else k per scale (16 or 32)
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PACKED: tl.constexpr,  # two 4-bit codes a byte: k = j in the low nibble of byte j, k = j + half in the high
    PARTIAL: tl.constexpr,  # write float32 partials of this program's K range (split-K), no bias
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k_cols)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        xmask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0)
        # the codes' tile as [BLOCK_K, BLOCK_N] (W^T)
        wmask = mask_k[:, None] & mask_n[None, :]
        q = tl.load(q_ptr + rows_n[None, :] * stride_qn + offs_k[:, None], mask=wmask, other=0)
        if PACKED:
            q = q.to(tl.int32)
            w = _decoded(
                q & 15,
                scale_ptr,
                offset_ptr,
                rows_n,
                mask_n,
                k0,
                k_end,
                stride_sn,
                GROUP,
                HAS_OFFSETS,
                BLOCK_K,
                BLOCK_N,
            )
            acc += mma(x, w.to(x.dtype), DOT_FP32)
            x_hi = tl.load(x_rows + (offs_k + half)[None, :], mask=xmask, other=0.0)
            w_hi = _decoded(
                q >> 4,
                scale_ptr,
                offset_ptr,
                rows_n,
                mask_n,
                k0 + half,
                k_end + half,
                stride_sn,
                GROUP,
                HAS_OFFSETS,
                BLOCK_K,
                BLOCK_N,
            )
            acc += mma(x_hi, w_hi.to(x.dtype), DOT_FP32)
        else:
            w = _decoded(
                q, scale_ptr, offset_ptr, rows_n, mask_n, k0, k_end, stride_sn, GROUP, HAS_OFFSETS, BLOCK_K, BLOCK_N
            )
            acc += mma(x, w.to(x.dtype), DOT_FP32)
    if GROUP == 0:
        acc = acc * tl.load(scale_ptr + rows_n, mask=mask_n, other=0.0)[None, :]
    out_at = pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if PARTIAL:
        tl.store(out_ptr + out_at, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes `[N, K]` (0..15, K even) as `[N, K / 2]` uint8: byte j holds k = j (low nibble) and k = j + K / 2
    (high). NOTE: halves rather than neighbours, so the kernel decodes two plain tiles with no shuffle."""
    half = codes.shape[1] // 2
    u = codes.to(torch.uint8)
    return (u[:, :half] | (u[:, half:] << 4)).contiguous()


@dataclass(frozen=True)
class CodedMatmulPlan:
    """Tile sizes and the K split of one call (`plan_coded_matmul`)."""

    block_m: int
    block_n: int
    block_k: int
    split: int


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_coded_matmul(m: int, n: int, k: int, sms: int) -> CodedMatmulPlan:
    """The regime for `m` rows (module docstring); decode splits K until ~2 programs per SM (`sms`) or 8 splits.

    NOTE: a function of the shape alone, so a captured CUDA graph replays the same launch."""
    if m > DECODE_ROWS:
        return CodedMatmulPlan(64, 64, 64, 1)
    block_n, block_k = 32, 128
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < _MAX_SPLIT and tiles * split < 2 * sms and triton.cdiv(k, block_k) >= 2 * split:
        split *= 2
    return CodedMatmulPlan(DECODE_ROWS, block_n, block_k, split)


def coded_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
    split: int | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for x `[M, K]` (bf16 / fp16 / fp32) and W as `codes` `[N, K]` int8 (`packed`: `[N, K / 2]`
    uint8 from `pack_nibbles`) with float32 `scales`: `[N, K // group]` (`group` 16 or 32, `offsets` alike or None)
    or `[N]` (`group` 0: per output channel, no offsets). Returns `[M, N]` in x's dtype. `split`: the decode regime's
    K split (tests; default: planned)."""
    m, k = x.shape
    n = codes.shape[0]
    cols, code_dtype = (k // 2, torch.uint8) if packed else (k, torch.int8)
    if codes.shape[1] != cols or codes.dtype != code_dtype or codes.stride(-1) != 1 or (packed and k % 2):
        raise ValueError(f"codes must be {code_dtype} [N, {cols}] (K={k}), got {codes.dtype} {list(codes.shape)}")
    if packed and group and (k // 2) % group:  # NOTE: the kernel loads a tile's scales per group
        raise ValueError(f"packed codes need K / 2 to be a multiple of the group {group}, got K={k}")
    if group not in (0, 16, 32) or (group and k % group) or (group == 0 and offsets is not None):
        raise ValueError(f"group must be 0 (per channel, no offsets), 16 or 32 dividing K={k}, got {group}")
    want = (n,) if group == 0 else (n, k // group)
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32 or t.stride(-1) != 1):
            raise ValueError(f"{name} must be contiguous float32 {list(want)}, got {t.dtype} {list(t.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    sms = _sm_count(x.device.index or 0) if x.is_cuda else 4
    plan = plan_coded_matmul(m, n, cols, sms)
    if split is not None and m <= DECODE_ROWS:
        plan = CodedMatmulPlan(plan.block_m, plan.block_n, plan.block_k, split)
    k_per_split = triton.cdiv(triton.cdiv(cols, plan.block_k), plan.split) * plan.block_k
    partial = plan.split > 1
    target = torch.empty((plan.split, m, n), dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.split)
    _coded_matmul_kernel[grid](
        x,
        codes,
        scales,
        scales if offsets is None else offsets,
        scales if bias is None else bias,
        target,
        m,
        n,
        cols,
        k // 2 if packed else 0,
        k_per_split,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        target.stride(-2),
        target.stride(0) if partial else 0,
        GROUP=group,
        HAS_OFFSETS=offsets is not None,
        HAS_BIAS=bias is not None,
        PACKED=packed,
        PARTIAL=partial,
        DOT_FP32=use_fp32_dot(x),
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k,
    )
    if partial:
        y = target.sum(0)
        if bias is not None:
            y += bias.float()
        out.copy_(y)
    return out
