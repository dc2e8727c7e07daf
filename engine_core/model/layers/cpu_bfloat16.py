"""CPU bfloat16 linears: the weight resident as bf16 packed for oneDNN, whose AVX-512 BF16 / AMX kernels multiply
bf16 inputs with fp32 accumulation; the arithmetic between the GEMMs stays fp32 (norms, rotary, attention, softmax,
sampling, the residual stream), the native ops beside the GEMMs reading and writing their bf16 inputs and products
(layer_ops.NativeCpuBf16Ops; a product whose consumer reads bf16 is returned as is: `CpuWeightForms.bf16_out`).

NOTE: why bf16 only inside the GEMMs: they are ~90 % of a float32 step's time and oneDNN's bf16 GEMM runs at twice
the fp32 rate from 16 rows up (docs/benchmarks.md, "bfloat16 on CPU"), while rounding the residual or a norm's sums
would compound over the layers.
A weight that is exactly GGUF blocks decoded keeps its codes for rows below `BF16_CODED_M` (fewer bytes per token at
batch 1, and exact); every other row count, and every weight without codes, runs oneDNN bf16.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
import torch

from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_forms import CpuWeightForms
from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels

log = structlog.get_logger(__name__)

# NOTE: measured per row count on a Zen 4 EPYC, 2 threads (docs/benchmarks.md): the coded kernel and oneDNN bf16 tie
# at 1-4 rows on cache-resident weights, and from DRAM the codes move 4x fewer bytes; from 8 rows bf16 wins
# (1.2x at 8, 1.5-1.8x at 16, 2x at 64).
BF16_CODED_M = 8
# A CPU with either runs oneDNN's bf16 GEMMs natively; without them oneDNN emulates bf16 slower than float32.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_gemm_unsupported(cpu_flags: Iterable[str], onednn_bf16: bool = True) -> str | None:
    """Why this CPU cannot run bf16 GEMMs fast (None: it can), from its /proc/cpuinfo flags and whether torch's
    oneDNN has bf16 kernels."""
    flags = set(cpu_flags)
    if not any(f in flags for f in BF16_CPU_FLAGS):
        return f"the CPU has none of {', '.join(BF16_CPU_FLAGS)}"
    if not onednn_bf16:
        return "torch's oneDNN has no bf16 kernels here"
    return None


def this_cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_bf16_gemms(cpu_flags: Iterable[str] | None = None) -> bool:
    """Whether `dtype="bfloat16"` runs bf16 GEMMs here; where not, says so once (the engine then runs float32)."""
    flags = this_cpu_flags() if cpu_flags is None else cpu_flags
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    reason = bf16_gemm_unsupported(flags, onednn)
    if reason is not None:
        log.warning("dtype=bfloat16 needs AVX-512 BF16 or AMX on CPU; running float32", reason=reason)
    return reason is None


def bf16_gemm_rows() -> CpuGemmRows:
    """The bf16 dispatch: codes below BF16_CODED_M (with the vectorized coded kernel), oneDNN bf16 above; no MKL."""
    coded = cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()
    return CpuGemmRows(BF16_CODED_M if coded else 0, BF16_CODED_M if coded else 0, NEVER)


class CpuBfloat16Method(CpuFloat32Method):
    """Keeps the weight's GGUF codes where `rows.coded_m` reads them, and one bf16 oneDNN copy for every other row
    count (no float32 panels or plain copy); `cpu_gemm` casts an fp32 x to bf16 for it and the product back to fp32
    unless its consumer reads bf16."""

    name = "cpu-bfloat16"

    def __init__(self, rows: CpuGemmRows | None = None) -> None:
        super().__init__(rows or bf16_gemm_rows())

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        weight = layer.weight.detach().float().contiguous()
        codes = cpu_kernels.coded_pack(weight) if self.rows.coded_m > 0 else None
        layer.cpu_forms = CpuWeightForms(
            out_features=weight.shape[0],
            rows=self.rows,
            coded=codes,
            panels=None,
            onednn=torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), None),
            plain=None,
        )
        layer.weight = None
        if layer.bias is not None:  # NOTE: added in fp32 after the bf16 product
            layer.bias = torch.nn.Parameter(layer.bias.detach().float().contiguous(), requires_grad=False)
