"""The `cpu` attention backend: decode rows through the native paged kernel, prefill chunks as the torch backend.

NOTE: measured on the 2-core AVX2 EPYC, one layer of SmolLM2 (9 query / 3 KV heads, fp32), 64 decode rows of
100-700 tokens (`benchmarks/cpu_bench.py attention`): gather + SDPA 8.6 ms, the native kernel 2.9 ms (1.2 vs 3.5 ms
at 100-400 tokens). The kernel reads each K/V row once straight from the cache; gather + SDPA moved it three times,
and SDPA's flash kernel is overhead-bound at one query row. Prefill chunks have many query rows, where SDPA is fine.
"""

from __future__ import annotations

import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.torch_backend import DecodeGroup, TorchAttentionBackend
from kernels import cpu as cpu_kernels


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _plan_decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        return []  # the kernel reads the block tables directly: no length groups, masks or gather workspace

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.num_prefills == 0 and meta.num_decodes == q.shape[0]:  # a decode-only step: no copies, no padding
            self._store(k, v, kv_cache, meta)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._decode(q, kv_cache, meta, None, out)
            return out
        return super().forward(q, k, v, kv_cache, meta)

    def _store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        cpu_kernels.store_kv(kv_cache, k, v, meta.slot_mapping)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        ws: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        cpu_kernels.paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, out=out
        )


def cpu_backend_supported(dtype: torch.dtype) -> bool:
    """float32 on a machine where the native kernels build (they are built here on first call)."""
    return dtype == torch.float32 and cpu_kernels.available()
