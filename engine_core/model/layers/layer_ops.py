"""The element-wise ops of a decoder layer (RMSNorm with its residual add, rotary, SiLU-and-mul), one implementation
per execution target, chosen by the model runner (`select_layer_ops`) and handed to the layers (`use_layer_ops`).

- `LayerOps`: eager torch, the reference (transformers' op order and fp32 upcast);
- `NativeCpuOps`: the fused native CPU ops (kernels/cpu), CPU float32 with the native kernels built;
- `TritonOps`: the fused Triton kernels (kernels/triton/fused.py), with the `triton` attention backend: one launch
  per op per layer instead of ~3-6 eager kernels.

NOTE: the fused ops update the residual in place: x is always a fresh projection output there, and the residual a
tensor of this forward (the embedding output, then the running sum).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from engine_core.model.layers.cpu_gemm_rows import NEVER
from kernels import cpu as cpu_kernels

CosSin = tuple[torch.Tensor, torch.Tensor]  # `[T, 1, head_dim]` rows for each token's position


def apply_rotary(x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
    """x: [T, heads, D]."""
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LayerOps:
    """Eager torch: the reference the fused implementations are tested against."""

    name = "torch"
    # whether silu_and_mul takes a bf16 gate/up product and returns bf16 with fp32 arithmetic (MLP.hand_off_bf16)
    silu_reads_bf16 = False
    # whether add_rms_norm and split_rotate_qkv take bf16 x (qkv's, o_proj's and down's bf16 products:
    # LlamaForCausalLM.use_layer_ops)
    reads_bf16_products = False

    def for_bf16_gemms(self, from_rows: int) -> LayerOps:
        """These ops for a model whose linears run bf16 GEMMs from `from_rows` rows (no change by default)."""
        return self

    def fp32_out(self) -> LayerOps:
        """These ops for the final norm, whose output (the hidden states) stays float32."""
        return self

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual)."""
        if residual is not None:
            x = x + residual
        residual = x
        # NOTE: same op order and fp32 upcast as transformers' LlamaRMSNorm, so fp32 logits match bit for bit-ish.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), residual

    def split_rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: CosSin, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[T, heads, D]` from the fused projection's output, q and k rotated."""
        q, k, v = _split(qkv, num_heads, num_kv_heads, head_dim)
        return apply_rotary(q, cos_sin), apply_rotary(k, cos_sin), v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


def _split(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


class NativeCpuOps(LayerOps):
    name = "native-cpu"
    silu_reads_bf16 = True

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            out = x.clone()
            cpu_kernels.add_rms_norm(out, None, weight, eps)
            return out, x
        cpu_kernels.add_rms_norm(x, residual, weight, eps)
        return x, residual

    def split_rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: CosSin, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        cos, sin = cos_sin
        # rotates q and k (adjacent in each row) in place, one pass
        cpu_kernels.rotary_embedding(qkv, cos.view(t, -1), sin.view(t, -1), num_heads + num_kv_heads, head_dim)
        return _split(qkv, num_heads, num_kv_heads, head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(gate_up)

    def for_bf16_gemms(self, from_rows: int) -> LayerOps:
        return NativeCpuBf16Ops(from_rows)


class NativeCpuBf16Ops(NativeCpuOps):
    """The native ops around bf16 GEMMs (model/layers/cpu_bfloat16.py): from `from_rows` rows the norm reads the
    previous GEMM's bf16 product and writes the next GEMM's bf16 input, and the rotary reads qkv's bf16 product, one
    pass each instead of a cast on either side; the residual, q/k/v and the arithmetic stay fp32, and the bits are
    the casts' (kernels/cpu/fused_ops.cpp, rms_norm_to and rotary_embedding_to). Below `from_rows` the GEMMs read
    fp32 (GGUF codes), so the norm writes fp32."""

    name = "native-cpu-bf16"
    reads_bf16_products = True

    def __init__(self, from_rows: int) -> None:
        self.from_rows = from_rows

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(x.shape, dtype=torch.bfloat16 if x.shape[0] >= self.from_rows else torch.float32)
        cpu_kernels.rms_norm_to(out, x, residual, weight, eps)
        return out, x if residual is None else residual  # NOTE: the first layer's x is the fp32 embedding

    def split_rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: CosSin, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if qkv.dtype != torch.bfloat16:  # a GGUF-coded product (below from_rows)
            return super().split_rotate_qkv(qkv, cos_sin, num_heads, num_kv_heads, head_dim)
        t = qkv.shape[0]
        cos, sin = cos_sin
        out = torch.empty(qkv.shape, dtype=torch.float32)
        cpu_kernels.rotary_embedding_to(out, qkv, cos.view(t, -1), sin.view(t, -1), num_heads + num_kv_heads, head_dim)
        return _split(out, num_heads, num_kv_heads, head_dim)

    def fp32_out(self) -> LayerOps:
        return NativeCpuBf16Ops(NEVER)


class TritonOps(LayerOps):
    """NOTE: `kernels.triton` is imported on construction, not at the top, so that the CPU engine never imports
    Triton."""

    name = "triton"

    def __init__(self) -> None:
        self.kernels = importlib.import_module("kernels.triton")

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, weight, eps), x
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps)

    def split_rotate_qkv(
        self, qkv: torch.Tensor, cos_sin: CosSin, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = qkv.shape[0]
        q, k, v = _split(qkv, num_heads, num_kv_heads, head_dim)
        cos, sin = cos_sin
        half = cos.shape[-1] // 2
        # in place on the q/k views of qkv, one kernel each
        self.kernels.rotary_embedding_neox(None, q, k, cos.view(t, -1)[:, :half], sin.view(t, -1)[:, :half])
        return q, k, v

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)


TORCH_OPS = LayerOps()


def select_layer_ops(device: torch.device, dtype: torch.dtype, attention_backend: str) -> LayerOps:
    """Triton's fused ops with the `triton` backend (also on CPU, interpreted: tests); the native ops on CPU float32
    where the kernels built; eager torch otherwise."""
    if attention_backend == "triton":
        return TritonOps()
    if device.type == "cpu" and dtype == torch.float32 and cpu_kernels.available():
        return NativeCpuOps()
    return TORCH_OPS
