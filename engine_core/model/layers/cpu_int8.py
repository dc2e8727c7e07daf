"""CPU int8 linears (`quantization="int8"`): each weight resident once, as int8 codes per output channel
(symmetric, float32 scales), read by two kernels of torch's CPU build, both on those same codes:
- below `w8a8_m` rows, weight-only (`torch._weight_int8pack_mm`): 1 byte per weight streamed and widened in
  registers, activations bf16, fp32 accumulation;
- from `w8a8_m` rows, W8A8 (`torch._int_mm`, oneDNN's AVX-512 VNNI int8 GEMM): each row of x quantized to int8 with
  its own scale (dynamic per token), the int32 product scaled back by the row's and the channel's scales.
Norms, rotary, attention, the KV cache and sampling stay float32 through the float32 path's native kernels.

NOTE: why these two (docs/benchmarks.md, "int8 on CPU"): on this torch build `_weight_int8pack_mm` with float32
activations is 10-60x slower than bf16 oneDNN and `onednn.qlinear_pointwise` with a per-tensor activation scale ran
its reference path (100x slower); `_int_mm` on CPU is oneDNN's VNNI GEMM. The row count from which W8A8 wins is
raced once per process (`w8a8_from_rows`), as `mkl_from_rows` races MKL.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine_core.model.layers.int8_gemm import Int8Weight, int8_gemm, quantize_per_channel, w8a8_from_rows
from engine_core.model.layers.linear import Linear, LinearMethod

# A CPU with one of these runs oneDNN's int8 GEMM (`_int_mm`) on int8 dot-product instructions; without them it
# emulates them, slower than bf16 or float32, so int8 is refused there.
INT8_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def int8_unsupported(cpu_flags: Iterable[str]) -> str | None:
    """Why this CPU cannot run int8 GEMMs fast (None: it can), from its /proc/cpuinfo flags."""
    flags = set(cpu_flags)
    if not any(f in flags for f in INT8_CPU_FLAGS):
        return f"quantization='int8' needs a CPU with one of {', '.join(INT8_CPU_FLAGS)}; this one has none"
    return None


class CpuInt8Method(LinearMethod):
    """Quantizes the loaded float32 weight per output channel and drops it; `w8a8_m`: the W8A8 threshold (this
    CPU's raced one unless given; tests move it)."""

    name = "cpu-int8"
    native_decode = False  # NOTE: decode steps run the layer loop (kernels/cpu/decode_step.cpp reads float forms)

    def __init__(self, w8a8_m: int | None = None) -> None:
        self.w8a8_m = w8a8_from_rows() if w8a8_m is None else w8a8_m

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        codes, scale = quantize_per_channel(layer.weight)
        layer.int8 = Int8Weight(codes, scale, scale.to(torch.bfloat16), self.w8a8_m)
        layer.weight = None
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(layer.bias.detach().float().contiguous(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert layer.int8 is not None
        return int8_gemm(layer.int8, x, layer.bias)

    def resident_bytes(self, layer: Linear) -> int:
        return 0 if layer.int8 is None else layer.int8.nbytes()
