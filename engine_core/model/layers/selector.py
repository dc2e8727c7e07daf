"""Which `LinearMethod` a model's linears get, from the device and dtype the runner serves."""

from __future__ import annotations

import torch

from engine_core.model.layers.cpu_bfloat16 import CpuBfloat16Method, this_cpu_flags
from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_gemm_rows import CpuGemmRows, can_pack
from engine_core.model.layers.cpu_int8 import CpuInt8Method, int8_dot_products
from engine_core.model.layers.cpu_int8_records import CpuInt8RecordsMethod
from engine_core.model.layers.cuda_codes import CudaCodesMethod
from engine_core.model.layers.gguf_a8 import GgufA8Method
from engine_core.model.layers.gguf_codes import GgufCodesMethod
from engine_core.model.layers.linear import UNQUANTIZED, LinearMethod


def select_linear_method(
    device: torch.device,
    dtype: torch.dtype,
    rows: CpuGemmRows | None = None,
    gemm_dtype: torch.dtype | None = None,
    int8: bool = False,
    a8: bool = False,
) -> LinearMethod:
    """CPU float32 (with oneDNN): the row-count dispatch, reading GGUF codes where a weight has them (`rows`: this
    CPU's thresholds unless given); with `gemm_dtype` bfloat16 (activations float32): bf16 weights through oneDNN
    (cpu_bfloat16.py); with `int8`: int8 weights (cpu_int8.py; on a CPU without int8 dot products as 8-bit
    records, cpu_int8_records.py); with `a8`: 4-bit GGUF codes times 8-bit activations
    (gguf_a8.py); CUDA: GGUF codes or (`int8`) int8 weights through the coded Triton GEMM, other weights plain
    (cuda_codes.py); anything else: `F.linear` on the plain weight."""
    if device.type == "cuda":
        return CudaCodesMethod(int8)
    if not can_pack(device, dtype):
        return UNQUANTIZED
    if int8:
        if int8_dot_products(this_cpu_flags()):
            return CpuInt8Method()
        return CpuInt8RecordsMethod(rows or CpuGemmRows.for_this_cpu())
    if gemm_dtype == torch.bfloat16:
        return CpuBfloat16Method(rows)
    rows = rows or CpuGemmRows.for_this_cpu()
    if a8:
        return GgufA8Method(rows)
    return GgufCodesMethod(rows) if rows.coded_m > 0 else CpuFloat32Method(rows)
