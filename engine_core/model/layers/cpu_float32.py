"""CPU float32 linears: the weight resident in the forms its row-count dispatch reads (panel kernel, oneDNN, MKL)."""

from __future__ import annotations

import torch

from engine_core.model.layers.cpu_forms import cpu_gemm, pack_forms
from engine_core.model.layers.cpu_gemm_rows import CpuGemmRows
from engine_core.model.layers.linear import Linear, LinearMethod


class CpuFloat32Method(LinearMethod):
    """Packs the float32 weight into the forms `rows` reaches and drops the layer's plain parameter.

    NOTE: the plain weight stays resident only where MKL runs (`rows.large_m`); a tied LM head's weight is the
    embedding's, which the embedding keeps anyway.
    """

    name = "cpu-float32"

    def __init__(self, rows: CpuGemmRows) -> None:
        self.rows = rows

    def codes(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's block codes, for the methods that read them (gguf_codes.py); none here."""
        return None

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        weight = layer.weight.detach().contiguous()
        layer.cpu_forms = pack_forms(weight, self.rows, self.codes(layer, weight))
        layer.weight = None
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(layer.bias.detach().contiguous(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        assert layer.cpu_forms is not None
        return cpu_gemm(layer.cpu_forms, x, layer.bias)

    def resident_bytes(self, layer: Linear) -> int:
        return 0 if layer.cpu_forms is None else layer.cpu_forms.nbytes()
