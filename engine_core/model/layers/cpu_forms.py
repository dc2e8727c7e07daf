"""The resident forms of a CPU float32 linear weight and the row-count dispatch over them.

One dispatch, read by both executions of a step: `cpu_gemm` (the layer loop) and kernels/cpu/decode_step.cpp (the
native decode step, handed the same `CpuWeightForms` by model/native_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.int8_gemm import Int8Weight, int8_gemm
from kernels import cpu as cpu_kernels


@dataclass
class CpuWeightForms:
    """A weight `[out_features, in]` in each form some row count reads (None: no row count reaches it)."""

    out_features: int
    rows: CpuGemmRows
    coded: torch.Tensor | None  # `coded_pack` records: rows below rows.coded_m
    # `panel_pack` panels (float32), or `bf16_pack` pair panels (bf16 weights: cpu_bfloat16.py): rows below
    # rows.onednn_m without codes
    panels: torch.Tensor | None
    onednn: torch.Tensor | None  # oneDNN packed: rows from rows.onednn_m
    plain: torch.Tensor | None  # float32 [out, in] for MKL: rows from rows.large_m
    # NOTE: set by the model where the consumer reads bf16 (gate/up into the native SiLU-and-mul, qkv into the rotary,
    # o_proj and down into the next norm: LlamaForCausalLM.use_layer_ops): a bf16 oneDNN product is returned as is,
    # not widened to fp32 in a pass of its own.
    bf16_out: bool = False
    int8: Int8Weight | None = None  # int8 codes per channel (cpu_int8.py): every row count, no other form

    @property
    def bf16(self) -> bool:
        """Whether the GEMMs past the codes read bf16 (bf16 x in, fp32 accumulation)."""
        return any(t is not None and t.dtype == torch.bfloat16 for t in (self.panels, self.onednn))

    def nbytes(self) -> int:
        forms = (self.coded, self.panels, self.onednn, self.plain)
        own = sum(t.numel() * t.element_size() for t in forms if t is not None)
        return own + (0 if self.int8 is None else self.int8.nbytes())


def pack_forms(weight: torch.Tensor, rows: CpuGemmRows, coded: torch.Tensor | None) -> CpuWeightForms:
    """The forms of `weight` that `rows` reaches; `coded`: its block codes, if it has them."""
    n = weight.shape[0]
    coded = coded if rows.coded_m > 0 else None
    # rows from `first` on reach the float32 forms: every row count (from 1) without codes, those from coded_m with
    first = 1 if coded is None else max(1, rows.coded_m)
    return CpuWeightForms(
        out_features=n,
        rows=rows,
        coded=coded,
        panels=cpu_kernels.panel_pack(weight) if first < rows.onednn_m else None,
        # NOTE: no batch-size hint: one layout serves every row count (a hint of 1 or 2048 was slower elsewhere).
        onednn=torch.ops.mkldnn._reorder_linear_weight(weight, None)
        if max(first, rows.onednn_m) < rows.large_m
        else None,
        plain=weight if max(first, rows.large_m) < NEVER else None,
    )


def cpu_gemm(forms: CpuWeightForms, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` through the form this row count reads (the same order as decode_step.cpp's `project`): each
    row count takes the first form of codes (4-bit ones with 8-bit activations from `a8_m`), panels, oneDNN it
    reaches that the weight has (int8 weights: their own dispatch, int8_gemm.py)."""
    if forms.int8 is not None:
        return int8_gemm(forms.int8, x, bias)
    m = x.shape[0]
    rows = forms.rows
    if m >= rows.a8_m and forms.coded is not None and cpu_kernels.coded_a8_reads(forms.coded):
        return cpu_kernels.coded_a8_linear(_float_rows(x), forms.coded, forms.out_features, bias)
    if m < rows.coded_m and forms.coded is not None:
        return cpu_kernels.coded_linear(_float_rows(x), forms.coded, forms.out_features, bias)
    if m < rows.onednn_m and forms.panels is not None:
        if forms.panels.dtype == torch.bfloat16:  # bf16 pair panels: the product in the dtype its consumer reads
            out = torch.bfloat16 if forms.bf16_out else torch.float32
            return cpu_kernels.bf16_linear(_bf16_rows(x), forms.panels, forms.out_features, bias, out)
        return cpu_kernels.panel_linear(_float_rows(x), forms.panels, forms.out_features, bias)
    if m >= rows.large_m:
        assert forms.plain is not None
        return nn.functional.linear(x.float(), forms.plain, bias)
    assert forms.onednn is not None
    if forms.onednn.dtype == torch.bfloat16:  # bf16 weights (cpu_bfloat16.py): bf16 in, fp32 accumulation, bf16 out
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), forms.onednn, bias, "none", [], "")
        return y if forms.bf16_out else y.float()
    return torch.ops.mkldnn._linear_pointwise(x, forms.onednn, bias, "none", [], "")


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the float32 kernels read it: float32 (a bf16 SiLU-and-mul output widened) with contiguous rows."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the bf16 kernel reads it: bf16 (an fp32 x rounded, as oneDNN's bf16 path rounds it) with contiguous
    rows."""
    x = x.to(torch.bfloat16)
    return x if x.stride(-1) == 1 else x.contiguous()
