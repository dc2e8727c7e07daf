"""CPU int8 linears (`quantization="int8"`): each weight resident once, as int8 codes per output channel
(symmetric, float32 scales), read by two kernels on those same codes (kernels/cpu/int8_ops.cpp):
- below `w8a8_m` rows, weight-only: 1 byte per weight streamed; with AVX-512 VNNI each row of x quantized to 16 bits
  (its own scale) into exact integer dot products with the codes, as good as float32 activations for the output
  (without VNNI: the codes widened to float32 in registers, float32 activations and accumulation);
- from `w8a8_m` rows, W8A8 (`torch._int_mm`, oneDNN's AVX-512 VNNI int8 GEMM): each row of x quantized to int8 with
  its own scale (dynamic per token) in one native pass, the int32 product scaled back by the row's and the
  channel's scales (+ bias) in place in another.
Norms, rotary, attention, the KV cache and sampling stay float32 through the float32 path's native kernels, and
decode-only steps run the native whole-step decode (kernels/cpu/decode_step.cpp calls the same op). On a CPU without
int8 dot products the same codes are kept as the coded kernel's records instead (cpu_int8_records.py).

NOTE: why these two (docs/benchmarks.md, "int8 on CPU"): `_int_mm` on CPU is oneDNN's VNNI GEMM, 1.8x bf16 oneDNN
from 16 rows; at a few rows the bytes of W are the cost, which the weight-only kernel streams once. torch's own
weight-only kernel (`_weight_int8pack_mm`) wants bf16 x and costs ~0.1 ms a call; `onednn.qlinear_pointwise` with a
per-tensor activation scale ran its reference path (100x slower). The row count from which W8A8 wins is raced once
per process (`w8a8_from_rows`), as `mkl_from_rows` races MKL.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_forms import CpuWeightForms
from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.int8_gemm import Int8Weight, quantize_per_channel, w8a8_from_rows
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels

# A CPU with one of these runs oneDNN's int8 GEMM (`_int_mm`) on int8 dot-product instructions; one without them
# but with RECORDS_CPU_FLAGS keeps the codes as the coded kernel's 8-bit records, weight-only (cpu_int8_records.py);
# anything else is refused.
INT8_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
RECORDS_CPU_FLAGS = ("avx2", "fma")


def int8_dot_products(cpu_flags: Iterable[str]) -> bool:
    """Whether this CPU (its /proc/cpuinfo flags) has int8 dot-product instructions: the int8 form here, else the
    records form."""
    return any(f in set(cpu_flags) for f in INT8_CPU_FLAGS)


def int8_unsupported(cpu_flags: Iterable[str]) -> str | None:
    """Why this CPU cannot run int8 weights fast (None: it can), from its /proc/cpuinfo flags."""
    flags = set(cpu_flags)
    if int8_dot_products(flags):
        return None
    if all(f in flags for f in RECORDS_CPU_FLAGS) and cpu_kernels.available() and cpu_kernels.coded_linear_vectorized():
        return None
    return (
        f"quantization='int8' needs a CPU with one of {', '.join(INT8_CPU_FLAGS)}, or with "
        f"{' and '.join(RECORDS_CPU_FLAGS)} and the native CPU kernels; this one has neither"
    )


# NOTE: no float32 form reaches any row count (the int8 codes serve them all), so the float thresholds are off.
INT8_ROWS = CpuGemmRows(coded_m=0, onednn_m=0, large_m=NEVER)


class CpuInt8Method(CpuFloat32Method):
    """Quantizes the loaded float32 weight per output channel into `cpu_forms.int8` and drops it; `w8a8_m`: the
    W8A8 threshold (this CPU's raced one unless given; tests move it). `apply` is the float methods' `cpu_gemm`,
    which sends an int8 form to `int8_gemm`."""

    name = "cpu-int8"

    def __init__(self, w8a8_m: int | None = None) -> None:
        super().__init__(INT8_ROWS)
        self.w8a8_m = w8a8_from_rows() if w8a8_m is None else w8a8_m

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        codes, scale = quantize_per_channel(layer.weight)
        int8 = Int8Weight(codes, scale, self.w8a8_m)
        layer.cpu_forms = CpuWeightForms(codes.shape[0], self.rows, None, None, None, None, int8=int8)
        layer.weight = None
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(layer.bias.detach().float().contiguous(), requires_grad=False)
