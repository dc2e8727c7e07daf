"""CUDA linears whose weight is kept as int8 codes on the GPU and multiplied through the coded Triton GEMM
(kernels/triton/coded_matmul.py), which decodes each tile in registers: no float copy of the weight is resident.

- a GGUF weight (every format the file's linears use: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): its codes as
  the file holds them (4-bit ones two a byte, others one a byte), scales and offsets per group of 32 (16 for Q6_K,
  or a fused projection that mixes it in: `cat_rows`), read from the file by the loader (gguf_kquants.py,
  gguf_legacy_codes.py);
- `quantization="int8"`: each weight quantized per output channel at load (`quantize_per_channel`, as on CPU; from
  float32 / bf16 / fp16 / GGUF values or a compressed-tensors checkpoint's merged int8), weight-only: activations
  stay in the model's dtype (no W8A8 on CUDA);
- any other weight (float checkpoints without `int8`, tensor-parallel shards, whose GGUF codes are not sliced):
  the plain weight through `F.linear`, as `UnquantizedLinearMethod`.
The kernel's launch depends on the row count alone (no host sync, the same buffers' shapes each call), so the decode
and mixed steps' CUDA graphs capture it like any other op.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
from torch import nn

from engine_core.model.layers.device_codes import DeviceCodes
from engine_core.model.layers.int8_gemm import quantize_per_channel
from engine_core.model.layers.linear import Linear, LinearMethod


@functools.cache
def _kernel() -> ModuleType:
    """kernels/triton/coded_matmul.py, imported on first use (on CUDA): the CPU engine never imports triton."""
    return importlib.import_module("kernels.triton.coded_matmul")


class CudaCodesMethod(LinearMethod):
    """`int8`: quantize every weight per output channel; otherwise keep a weight's GGUF codes where it has them."""

    name = "cuda-codes"
    native_decode = False

    def __init__(self, int8: bool) -> None:
        self.int8 = int8
        if int8:
            self.name = "cuda-int8"

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        weight = layer.weight.detach()
        given = None if self.int8 else layer.loaded_codes()
        if given is None and not self.int8:
            return  # no codes: the plain weight, as `UnquantizedLinearMethod`
        kernel = _kernel()
        if given is not None:
            device = weight.device
            offsets = None if given.offsets is None else given.offsets.to(device).contiguous()
            q = given.q
            # 4-bit codes (Q4_0, Q4_1, Q4_K) two a byte: half the bytes a decode step reads
            # (the halves must start on a group boundary: the kernel loads a tile's scales per group)
            aligned = q.shape[1] % 2 == 0 and (q.shape[1] // 2) % given.group == 0
            packed = given.bits == 4 and aligned and int(q.min()) >= 0 and int(q.max()) <= 15
            q = (kernel.pack_nibbles(q) if packed else q).to(device).contiguous()
            codes = DeviceCodes(q, given.scales.to(device).contiguous(), offsets, given.group, packed=packed)
        else:
            q, scale = quantize_per_channel(weight)
            codes = DeviceCodes(q, scale, None, 0)
        layer.device_codes = codes
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        codes = layer.device_codes
        if codes is None:
            assert layer.weight is not None
            return nn.functional.linear(x, layer.weight, layer.bias)
        rows = x.reshape(-1, x.shape[-1])
        y = _kernel().coded_matmul(
            rows, codes.codes, codes.scales, codes.offsets, codes.group, layer.bias, packed=codes.packed
        )
        return y.view(*x.shape[:-1], y.shape[-1])

    def resident_bytes(self, layer: Linear) -> int:
        return super().resident_bytes(layer) if layer.device_codes is None else layer.device_codes.nbytes()
