"""CPU bfloat16 linears: the weight resident once as bf16, packed for the native AVX-512 BF16 kernel
(kernels/cpu/bf16_linear.cpp, `bf16_pack` pair panels) or, where the native kernels did not build, for oneDNN; both
multiply bf16 inputs with fp32 accumulation. The arithmetic between the GEMMs stays fp32 (norms, rotary, attention,
softmax, sampling, the residual stream), the native ops beside the GEMMs reading and writing their bf16 inputs and
products (layer_ops.NativeCpuBf16Ops; a product whose consumer reads bf16 is returned as is: `bf16_out`).

NOTE: why bf16 only inside the GEMMs: they are ~90 % of a float32 step's time and a bf16 GEMM runs at twice the fp32
rate from 16 rows up (docs/benchmarks.md, "bfloat16 on CPU"), while rounding the residual or a norm's sums would
compound over the layers. Why the native kernel, not oneDNN: oneDNN's bf16 GEMM ran decode's 32-128-row steps at
~63 % of its prefill rate; the native kernel is ahead at most (shape, rows) pairs from 8 to 2,048 and runs the bf16
workload 1.07-1.17x faster end to end (docs/decisions.md). One packed form serves every row count, so the weight is
resident once either way.
A weight that is exactly GGUF blocks decoded keeps its codes for rows below `BF16_CODED_M` (fewer bytes per token at
batch 1, and exact); every other row count, and every weight without codes, runs the bf16 GEMM.
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
    """The bf16 dispatch: codes below BF16_CODED_M (with the vectorized coded kernel), above them the native bf16
    kernel at every row count (its pair panels are `CpuWeightForms.panels`: `onednn_m` NEVER), or oneDNN bf16 where
    the native kernels lack it; no MKL."""
    native = cpu_kernels.available()
    coded_m = BF16_CODED_M if native and cpu_kernels.coded_linear_vectorized() else 0
    return CpuGemmRows(coded_m, NEVER if native and cpu_kernels.bf16_linear_native() else coded_m, NEVER)


class CpuBfloat16Method(CpuFloat32Method):
    """Keeps the weight's GGUF codes where `rows.coded_m` reads them, and one bf16 copy for every other row count:
    `bf16_pack` panels below `rows.onednn_m`, else oneDNN's packed form (no float32 panels or plain copy);
    `cpu_gemm` rounds an fp32 x to bf16 for it and returns the product in fp32 unless its consumer reads bf16."""

    name = "cpu-bfloat16"

    def __init__(self, rows: CpuGemmRows | None = None) -> None:
        super().__init__(rows or bf16_gemm_rows())

    def process_weights_after_loading(self, layer: Linear) -> None:
        assert layer.weight is not None, "the weights were processed already"
        weight = layer.weight.detach().float().contiguous()
        codes = cpu_kernels.coded_pack(weight) if self.rows.coded_m > 0 else None
        bf16 = weight.to(torch.bfloat16)
        native = self.rows.onednn_m > (1 if codes is None else self.rows.coded_m)  # some row count reads the panels
        layer.cpu_forms = CpuWeightForms(
            out_features=weight.shape[0],
            rows=self.rows,
            coded=codes,
            panels=cpu_kernels.bf16_pack(bf16) if native else None,
            onednn=None if self.rows.onednn_m >= NEVER else torch.ops.mkldnn._reorder_linear_weight(bf16, None),
            plain=None,
        )
        layer.weight = None
        if layer.bias is not None:  # NOTE: added in fp32 after the bf16 product
            layer.bias = torch.nn.Parameter(layer.bias.detach().float().contiguous(), requires_grad=False)
