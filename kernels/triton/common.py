"""Small helpers shared by the attention kernels (device-side `mma`, host-side launch choices)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Softmax runs in base 2 (exp2 is the native instruction): scores are pre-multiplied by scale * log2(e).
LOG2E = math.log2(math.e)


@triton.jit
def mma(a, b, DOT_FP32: tl.constexpr):
    """`a @ b` with fp32 accumulation.

    NOTE: DOT_FP32 upcasts both operands and asks for IEEE fp32 products. We need it in two cases:
    - fp32 inputs on a GPU: the default `tl.dot` precision for fp32 is TF32 (~1e-3 relative error), far from what a
      fp32 caller expects;
    - the Triton interpreter (CPU): it multiplies bf16 operands as their raw uint16 bit patterns (a Triton 3.x bug),
      so bf16 dots must be done in fp32 there. A bf16 x bf16 product is exact in fp32, so this matches what a tensor
      core computes (fp32 accumulation) up to summation order.
    On a GPU with bf16/fp16 inputs DOT_FP32 is False and `tl.dot` runs on the tensor cores.
    """
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


def use_fp32_dot(t: torch.Tensor) -> bool:
    """Whether kernels reading `t` must run their `tl.dot`s in fp32 (see `mma`)."""
    return t.dtype == torch.float32 or not t.is_cuda


def check_block_size(field: str, value: int, minimum: int = 16) -> int:
    """A tile extent given by a caller: `tl.arange` needs a power of two, `tl.dot` a dimension >= 16.

    Raises ValueError naming the field, instead of the compiler's error deep inside the kernel.
    """
    if value < minimum or value & (value - 1):
        raise ValueError(f"{field} must be a power of two >= {minimum}, got {value}")
    return value


def pow2_at_least(n: int, floor: int = 1) -> int:
    """Next power of two >= max(n, floor); `tl.arange` extents must be powers of two, `tl.dot` dims >= 16."""
    return max(triton.next_power_of_2(max(n, 1)), floor)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the last (head_dim) axis with stride 1; copy the rare tensor that is not laid out that way."""
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The (block, slot, head) strides of the K cache, then of the V cache: the order every paged kernel takes them."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])
