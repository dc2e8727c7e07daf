"""The `cpu` attention backend: K/V writes and decode rows through the native paged kernels, prefill chunks through
the torch prefill helper it shares with the `torch` backend.

NOTE: measured on the 2-core AVX2 EPYC, one layer of SmolLM2 (9 query / 3 KV heads, fp32), 64 decode rows of
100-700 tokens (`benchmarks/cpu_bench.py attention`): gather + SDPA 8.6 ms, the native kernel 2.9 ms (1.2 vs 3.5 ms
at 100-400 tokens). The kernel reads each K/V row once straight from the cache; gather + SDPA moved it three times,
and SDPA's flash kernel is overhead-bound at one query row. Prefill chunks have many query rows, where SDPA is fine.
"""

from __future__ import annotations

import torch

from engine_core.attention.backend import AttentionBackend, AttentionMetadata
from engine_core.attention.torch_prefill import GatherWorkspace, TorchPrefill
from kernels import cpu as cpu_kernels


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, scale)
        self._workspace = GatherWorkspace(block_size, num_kv_heads, head_dim)
        self._prefill = TorchPrefill(num_kv_heads, head_dim, block_size, scale)

    def prepare(self, meta: AttentionMetadata) -> None:
        # NOTE: the decode kernel reads the block tables directly: only prefill chunks need masks and a workspace.
        self._workspace.needed_blocks = self._prefill.prepare(meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cpu_kernels.store_kv(kv_cache, k, v, meta.slot_mapping)  # skips -1 (padding) slots
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            cpu_kernels.paged_decode_attention(
                q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, out=out[:nd]
            )
        if meta.num_prefills:
            self._prefill.forward(q[nd:], kv_cache, meta, self._workspace.buffer(kv_cache), out[nd:])
        end = nd + sum(meta.prefill_query_lens_cpu)
        if end < out.shape[0]:
            out[end:].zero_()  # padding rows belong to no sequence
        return out


def cpu_backend_supported(dtype: torch.dtype) -> bool:
    """float32 on a machine where the native kernels build (they are built here on first call)."""
    return dtype == torch.float32 and cpu_kernels.available()
