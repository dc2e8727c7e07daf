"""CPU linears whose float32 weight is exactly GGUF blocks decoded: kept as those codes alone (4 to 8 bits per weight).

`coded_pack` (kernels/cpu/coded_linear.cpp) finds the Q4_0 / Q4_1 (4-bit) or Q5_0 / Q5_1 / Q8_0 (8-bit) codes from
the float32 weight alone and accepts them only if decoding gives every weight back bit for bit; the K-quants (Q4_K,
Q5_K, Q6_K) come with their codes from the file (block_codes.py). `coded_linear` reads them at every row count with
the panel kernel's bits, so the weight keeps no float32 form. A weight without codes (float32 / bf16 / f16
checkpoints) keeps the float32 forms (cpu_float32.py).
"""

from __future__ import annotations

import torch

from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels


class GgufCodesMethod(CpuFloat32Method):
    name = "gguf-codes"

    def codes(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor | None:
        if self.rows.coded_m <= 0:
            return None
        given = layer.loaded_codes()
        return given.records() if given is not None else cpu_kernels.coded_pack(weight)
