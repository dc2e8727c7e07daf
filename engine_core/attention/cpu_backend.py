"""The `cpu` attention backend: K/V writes, decode rows and prefill chunks all through the native paged kernels, which
read K/V straight from the cache (no gather workspace, no masks).

NOTE: measured on the 2-core EPYC, one layer of SmolLM2 (9 query / 3 KV heads, fp32), 64 decode rows of
100-700 tokens (`benchmarks/cpu_bench.py attention`): gather + SDPA 8.6 ms, the native kernel 2.9 ms (1.2 vs 3.5 ms
at 100-400 tokens). The kernel reads each K/V row once straight from the cache; gather + SDPA moved it three times,
and SDPA's flash kernel is overhead-bound at one query row.
NOTE: prefill chunks through the native paged prefill kernel, not gather + SDPA (`benchmarks/cpu_bench.py prefill`,
same layer, 2 threads, 3 runs): 5 chunks of ~410 tokens without context 15.2-18.1 -> 6.7-7.5 ms (53-64 -> 129-144
GFLOP/s), one chunk of 512 over 1536 cached tokens 18.0-21.1 -> 12.1-13.2 ms (100-117 -> 160-175 GFLOP/s). In a
2,048-token prefill step of SmolLM2-135M (5 prompts, 30 layers) attention went from 490-511 ms of SDPA (+ ~20 ms of
gather) to 211-219 ms. SDPA's CPU flash kernel is slow on causal chunks; the native one folds each KV head's query
group into its rows (one K/V load for the group), skips the masked triangle and keeps its tiles in registers.
"""

from __future__ import annotations

import torch

from engine_core.attention.backend import AttentionBackend, AttentionMetadata
from kernels import cpu as cpu_kernels


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    # NOTE: the native kernels widen a bf16 cache to fp32 on load (exact) and compute in fp32: half the bytes per
    # decode step, one rounding of each stored K/V (docs/benchmarks.md, "bfloat16 on CPU").
    cache_dtypes = ("bfloat16",)

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
            cpu_kernels.paged_prefill_attention(
                q[nd:],
                kv_cache,
                meta.prefill_block_tables,
                meta.prefill_seq_lens,
                meta.prefill_query_start_loc,
                self.scale,
                out=out[nd:],
            )
        end = nd + sum(meta.prefill_query_lens_cpu)
        if end < out.shape[0]:
            out[end:].zero_()  # padding rows belong to no sequence
        return out


def cpu_backend_supported(dtype: torch.dtype) -> bool:
    """float32 on a machine where the native kernels build (they are built here on first call)."""
    return dtype == torch.float32 and cpu_kernels.available()
