"""Linear layers that own their weight format (vLLM's `LinearMethodBase` / quant-method pattern).

A `Linear` holds its checkpoint weight as a float32 `[out, in]` parameter while the weights load; its
`weight_loader` writes each checkpoint tensor into its shard of a fused projection (Q/K/V, gate/up), so the model
definition names its fused layers and never slices weights itself. After loading, a `LinearMethod` turns the weight
into the form(s) its kernels read and drops what none of them reads (`process_weights_after_loading`), then serves
`y = x @ W.T + b` (`apply`):
- `UnquantizedLinearMethod` (here): the plain weight through `F.linear`: CUDA, bf16/fp16, and every layer before
  its weights are processed;
- `CpuFloat32Method` (cpu_float32.py): CPU float32, dispatched by row count (panel kernel, oneDNN, MKL);
- `GgufCodesMethod` (gguf_codes.py): the same, and a weight that is exactly GGUF blocks decoded is kept as its codes;
- `CpuBfloat16Method` (cpu_bfloat16.py), `CpuInt8Method` (cpu_int8.py): bf16 / int8 weights on CPU;
- `CudaCodesMethod` (cuda_codes.py): CUDA, GGUF codes or int8 per channel through the coded Triton GEMM.

NOTE: room for what comes next, not built: column/row sharding for
tensor parallelism narrows `weight_loader`'s copy to this rank's rows (column) or columns (row), as nano-vllm's
`ColumnParallelLinear` / `RowParallelLinear` do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine_core.model.layers.block_codes import BlockCodes, cat_rows

if TYPE_CHECKING:
    from engine_core.model.layers.cpu_forms import CpuWeightForms
    from engine_core.model.layers.device_codes import DeviceCodes


class LinearMethod(ABC):
    """How a `Linear`'s weight is stored and multiplied. Stateless: what a layer keeps lives on the layer."""

    name: str
    native_decode: bool = True  # whether kernels/cpu/decode_step.cpp can run this method's CPU forms

    @abstractmethod
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turns the loaded float32 weight into this method's resident form(s); runs once, after every weight."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T + b` for x `[rows, in_features]`."""

    def resident_bytes(self, layer: Linear) -> int:
        """Bytes of weight this layer holds in memory (every resident form, bias excluded)."""
        w = layer.weight
        return 0 if w is None else w.numel() * w.element_size()


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def process_weights_after_loading(self, layer: Linear) -> None:
        pass

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert layer.weight is not None
        return nn.functional.linear(x, layer.weight, layer.bias)


UNQUANTIZED = UnquantizedLinearMethod()


class Linear(nn.Module):
    """`y = x @ W.T + b` whose weight format is its `method`'s business.

    `output_sizes`: for a fused projection, the output rows of each shard in order (Q, K, V or gate, up): the
    checkpoint holds them as separate tensors, which `weight_loader` stacks. Parameters are allocated, not
    initialised: the loader overwrites each one and the model refuses a checkpoint that misses one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, output_sizes: Sequence[int] = ()) -> None:
        super().__init__()
        if output_sizes and sum(output_sizes) != out_features:
            raise ValueError(f"output_sizes {list(output_sizes)} do not add up to out_features {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = list(output_sizes) or [out_features]
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.method: LinearMethod = UNQUANTIZED
        self.cpu_forms: CpuWeightForms | None = None  # set by the CPU methods (cpu_forms.py), int8's too
        self.device_codes: DeviceCodes | None = None  # set by the CUDA codes method (cuda_codes.py)
        # Each shard's GGUF codes where the checkpoint gave them (K-quants), until the method has read them
        self.block_codes: list[BlockCodes | None] = [None] * self.num_shards

    @property
    def num_shards(self) -> int:
        return len(self.output_sizes)

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None, codes: BlockCodes | None = None
    ) -> None:
        """Copies a checkpoint tensor into `param` (this layer's weight or bias), or into rows of `shard` of it;
        `codes`: the weight's GGUF codes, of which `loaded` is the values."""
        if param is self.weight:
            self.block_codes[shard or 0] = codes
        if shard is None:
            if self.num_shards != 1:
                raise ValueError(f"a fused projection of {self.num_shards} shards needs a shard id")
            target = param.data
        else:
            start = sum(self.output_sizes[:shard])
            target = param.data.narrow(0, start, self.output_sizes[shard])
        if target.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {list(loaded.shape)} for a slot of {list(target.shape)}")
        target.copy_(loaded)

    def process_weights(self, method: LinearMethod) -> None:
        """Hands the loaded weight to `method`, which keeps the form(s) its dispatch reads."""
        self.method = method
        with torch.no_grad():
            method.process_weights_after_loading(self)
        self.block_codes = [None] * self.num_shards

    def loaded_codes(self) -> BlockCodes | None:
        """The whole weight's GGUF codes, every shard's stacked; None unless every shard came with codes."""
        parts = [c for c in self.block_codes if c is not None]
        return cat_rows(parts) if parts and len(parts) == self.num_shards else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def resident_bytes(self) -> int:
        return self.method.resident_bytes(self)

    def extra_repr(self) -> str:
        shards = f", output_sizes={self.output_sizes}" if self.num_shards > 1 else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        return f"{sizes}{shards}, {self.method.name}"


def process_linear_weights(model: nn.Module, method: LinearMethod) -> None:
    """Every `Linear` below `model` gets `method` (after the weights loaded and the model reached its dtype)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights(method)
