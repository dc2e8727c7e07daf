"""The int8 form of a CPU linear weight (`Int8Weight`: codes per output channel, float32 scales) and its two kernels
by row count, weight-only and W8A8 (why these: model/layers/cpu_int8.py); `w8a8_from_rows` races them at load.

Both run natively (kernels/cpu/int8_ops.cpp, one op for both, which the native decode step calls too); without the
native kernels, torch's: `_weight_int8pack_mm` (bf16 x) and `_int_mm` between torch passes over x and the product.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels

_W8A8_CANDIDATES = (2, 4, 8, 16, 32, 64)  # row counts raced; W8A8 from the smallest that wins it and every larger
_RACE_SHAPE = (576, 1536)  # in, out: a SmolLM2-sized projection
_ALWAYS = 0  # a w8a8_m every row count reaches
_NEVER = 1 << 62  # a w8a8_m no row count reaches


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes `[out, in]` and float32 scales `[out]` with `weight ~= codes * scale[:, None]`.

    NOTE: codes in [-127, 127] (no -128), so a row's negation is exact and the VNNI sums cannot overflow int32 over
    any model's hidden size (127 * 127 * 2^17 < 2^31). An all-zero row gets scale 1 and codes 0."""
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


@dataclass
class Int8Weight:
    """A linear's int8 form: codes `[out, in]` (row-major: `_int_mm` reads their transpose), float32 scales `[out]`,
    and the row count from which W8A8 runs."""

    codes: torch.Tensor
    scale: torch.Tensor
    w8a8_m: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale))


def _torch_weight_only(w: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), w.codes, w.scale.to(torch.bfloat16)).float()


def _torch_w8a8(w: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    # NOTE: the inf-norm is one pass over x (abs + amax would be two); rows of zeros get scale 1 (codes 0)
    s = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True).div_(127.0)
    s.masked_fill_(s == 0, 1.0)
    xq = torch.round(x / s).to(torch.int8)  # |x / s| <= 127 by construction
    return torch._int_mm(xq, w.codes.t()).float().mul_(s).mul_(w.scale)


def int8_gemm(w: Int8Weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` in float32 for x `[rows, in]` (float32, or bf16 widened), by row count (module docstring)."""
    x = x.float()
    if cpu_kernels.available():
        return cpu_kernels.int8_linear(x if x.stride(-1) == 1 else x.contiguous(), w.codes, w.scale, bias, w.w8a8_m)
    y = _torch_weight_only(w, x) if x.shape[0] < w.w8a8_m else _torch_w8a8(w, x.contiguous())
    return y if bias is None else y.add_(bias)


def _best_of(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):  # alternating, so both see the same load
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


@functools.cache
def w8a8_from_rows() -> int:
    """The smallest raced row count from which W8A8 beats weight-only at it and every larger raced count, on a
    SmolLM2-sized projection (best of 5 alternating, once per process, ~50 ms); the largest raced count at most."""
    k, n = _RACE_SHAPE
    gen = torch.Generator().manual_seed(0)
    codes, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    weight_only, w8a8 = Int8Weight(codes, scale, _NEVER), Int8Weight(codes, scale, _ALWAYS)
    wins = []
    for m in _W8A8_CANDIDATES:
        x = torch.randn(m, k, generator=gen)
        best = _best_of(
            {"weight_only": lambda x=x: int8_gemm(weight_only, x, None), "w8a8": lambda x=x: int8_gemm(w8a8, x, None)},
            5,
        )
        wins.append(best["w8a8"] < best["weight_only"])
    # NOTE: W8A8 from the largest raced count at the latest, whatever the race says: weight-only re-reads the
    # weights for every row, so at 64 rows it costs several times W8A8, and a race on a busy machine has been seen
    # to call it the winner there (which would run every 64-row step weight-only).
    from_rows = _W8A8_CANDIDATES[-1]
    for m, won in zip(reversed(_W8A8_CANDIDATES[:-1]), reversed(wins[:-1]), strict=True):
        if not won:
            break
        from_rows = m
    return from_rows
