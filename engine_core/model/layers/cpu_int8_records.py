"""`quantization="int8"` on a CPU without int8 dot products (AVX2 + FMA: Zen 1-3, Intel before Cascade Lake): each
weight's per-channel int8 codes (`quantize_per_channel`, the same codes as on VNNI CPUs) kept as `coded_linear`'s
8-bit records, the channel's scale as every 32-k block's d and m = 0, and multiplied weight-only at every row count
by the coded kernel: float32 activations and accumulation over w = scale * code (exact in float32), so the product is
the float32 product of the dequantized weight, W8A8's activation error never enters.

NOTE: why records and not `int8_linear` (cpu_int8.py) here: without VNNI, W8A8 has no fast kernel (oneDNN's
`_int_mm` emulates the dot products: ~2.3 GOP/s on a Zen 1 core pair against float32's ~60 GFLOP/s at 2,048 rows),
and `int8_linear`'s weight-only kernel there is portable code. The coded kernel reads 8-bit records at every row
count with AVX2 (in registers at a few rows, above that through panels decoded once into L2, at the float32 panel
kernel's speed), and the native decode step and a tied embedding read the records as they read a GGUF model's. The
cost: d and m per 32 k per column, 1.25 bytes per weight (the codes alone: 1; float32: 4).
"""

from __future__ import annotations

import torch

from engine_core.model.layers.block_codes import BLOCK, BlockCodes
from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_forms import CpuWeightForms
from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.int8_gemm import Int8Weight, quantize_per_channel
from engine_core.model.layers.linear import Linear


def int8_records(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`coded_linear`'s 8-bit records `[ceil(out/16), in/32, 640]` of per-channel codes `[out, in]` and scales
    `[out]` (in: a multiple of 32): every block's d is its channel's scale, m is 0."""
    rows, k = codes.shape
    scales = scale[:, None].expand(rows, k // BLOCK).contiguous()
    return BlockCodes(scales, torch.zeros_like(scales), codes, BLOCK, 8).records()


class CpuInt8RecordsMethod(CpuFloat32Method):
    """Quantizes the loaded float32 weight per output channel and keeps the codes as 8-bit records alone (a GGUF
    model's own codes are not read: int8 is what was asked for). A weight whose in_features is not a multiple of 32
    (which the records cannot hold) keeps its int8 codes for `int8_linear`'s weight-only kernel instead."""

    name = "cpu-int8-records"

    def __init__(self, rows: CpuGemmRows) -> None:
        if rows.coded_m <= 0:
            raise ValueError("quantization='int8' without int8 dot products needs the vectorized coded kernel (AVX2)")
        super().__init__(rows)

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        codes, scale = quantize_per_channel(layer.weight)
        if codes.shape[1] % BLOCK == 0:
            forms = CpuWeightForms(codes.shape[0], self.rows, int8_records(codes, scale), None, None, None)
        else:
            int8 = Int8Weight(codes, scale, NEVER)
            forms = CpuWeightForms(codes.shape[0], self.rows, None, None, None, None, int8=int8)
        layer.cpu_forms = forms
        layer.weight = None
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(layer.bias.detach().float().contiguous(), requires_grad=False)
