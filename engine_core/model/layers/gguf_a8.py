"""`quantization="gguf_a8"`: a .gguf model's 4-bit codes (Q4_0, Q4_1, Q4_K records) multiplied by the activations
quantized to 8 bits per 32-k block, in integer dot products (kernels/cpu/coded_a8_linear.cpp), at every row count.

The weights stay resident once, as the same records the exact path reads (gguf_codes.py); 8-bit records (Q5_0,
Q5_1, Q8_0 such as the default model's tied LM head, Q6_K) keep the exact float32 arithmetic. This is what
llama.cpp's CPU kernels and vLLM's CUDA GGUF kernels compute (activations in 8 bits per block), so greedy output is no
longer transformers' float32 decoding of the file: the quality table and the speed it buys are in
docs/benchmarks.md ("gguf_a8 on AVX2"); the exact path stays the default.

NOTE: why it exists: on a CPU without int8 or bf16 dot products (AVX2 + FMA) float32 GEMMs are bound by the FMA
ports; `vpmaddubsw` does a 4-bit code times an 8-bit activation at four times float32's products per instruction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from engine_core.model.layers.cpu_gemm_rows import CpuGemmRows
from engine_core.model.layers.gguf_codes import GgufCodesMethod
from kernels import cpu as cpu_kernels

A8_CPU_FLAGS = ("avx2", "fma")
# NOTE: every row count: on a Zen 1 EPYC the kernel beat the exact coded kernel at each of 1-2,048 rows over
# SmolLM2's 30 layers (1.36x at 1 row, 1.19x at 64, 1.44x at 2,048; docs/benchmarks.md, "gguf_a8 on AVX2").
A8_M = 1


def gguf_a8_unsupported(device: torch.device, cpu_flags: Iterable[str]) -> str | None:
    """Why `quantization="gguf_a8"` cannot run here (None: it can)."""
    if device.type != "cpu":
        return f"quantization='gguf_a8' runs on CPU, not {device}"
    missing = [f for f in A8_CPU_FLAGS if f not in set(cpu_flags)]
    if missing:
        needs = " and ".join(A8_CPU_FLAGS)
        return f"quantization='gguf_a8' needs a CPU with {needs}; this one lacks {', '.join(missing)}"
    if not (cpu_kernels.available() and cpu_kernels.coded_a8_supported()):
        return "quantization='gguf_a8' needs the native CPU kernels (kernels/cpu), which did not build here"
    return None


class GgufA8Method(GgufCodesMethod):
    """The GGUF codes method with 4-bit codes read by `coded_a8_linear` from `A8_M` rows (cpu_forms.cpu_gemm)."""

    name = "gguf-a8"

    def __init__(self, rows: CpuGemmRows) -> None:
        if rows.coded_m <= 0:
            raise ValueError("quantization='gguf_a8' needs the vectorized coded kernel (AVX2 + FMA or AVX-512)")
        super().__init__(replace(rows, a8_m=A8_M))
