"""The choice of attention backend: the one module that knows every implementation (and nothing imports back)."""

from __future__ import annotations

import structlog
import torch

from engine_core.attention.backend import AttentionBackend

log = structlog.get_logger(__name__)

BACKENDS = ("cpu", "torch", "triton")


def create_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> AttentionBackend:
    """`cpu` falls back to `torch` (logged) for dtypes or machines its native kernel does not serve."""
    # NOTE: implementations are imported on demand: `triton` pulls in Triton, which a CPU-only run never needs.
    if name == "cpu":
        from engine_core.attention.cpu_backend import CpuAttentionBackend, cpu_backend_supported

        if cpu_backend_supported(dtype):
            return CpuAttentionBackend(num_heads, num_kv_heads, head_dim, block_size, scale)
        log.warning("cpu attention backend unavailable for this dtype/machine; using torch", dtype=str(dtype))
        name = "torch"
    if name == "torch":
        from engine_core.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, block_size, scale)
    if name == "triton":
        from engine_core.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, block_size, scale)
    raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
