"""The `triton` attention backend: paged K/V writes plus paged decode and prefill attention, all Triton kernels.

Runs on CUDA tensors, and on CPU tensors through the Triton interpreter (slow, for tests and CPU-only machines;
`kernels.triton_mode` switches the interpreter on when no CUDA device is present).

NOTE: the prefill kernel reads a chunk's own K/V back from the cache after `store_kv`, so every token of a prefill
chunk needs a real slot; -1 slots are for padding only. Padding rows after the last chunk, and decode rows with
seq_len 0, get zero outputs.
"""

from __future__ import annotations

import torch

from engine_core.attention.backend import AttentionBackend, AttentionMetadata
from kernels.triton import decode_attention, prefill_attention, store_kv


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert q.shape[1:] == (self.num_heads, self.head_dim), (q.shape, self.num_heads, self.head_dim)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        assert k_cache.shape[1:] == (self.block_size, self.num_kv_heads, self.head_dim), (kv_cache.shape, k.shape)
        # First the writes: decode rows and prefill chunks then read their own new K/V back from the cache.
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

        if meta.prefill_tile_map is not None:
            return self._fixed_grid_forward(q, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            self._decode(q[:num_decodes], k_cache, v_cache, meta, out[:num_decodes])
        # NOTE: the host-side query lengths give the prefill token count without a device sync.
        end = num_decodes + sum(meta.prefill_query_lens_cpu)
        if meta.num_prefills > 0 and end > num_decodes:
            self._prefill(q[num_decodes:end], k_cache, v_cache, meta, out[num_decodes:end])
        if end < out.shape[0]:
            out[end:].zero_()  # padding rows past the last chunk belong to no sequence
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor
    ) -> None:
        decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.scale,
            meta.max_decode_seq_len,
            out=out,
            num_splits=meta.decode_num_splits,
        )

    def _prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
        tile_map: torch.Tensor | None = None,
    ) -> None:
        prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            self.scale,
            meta.max_prefill_query_len,
            out=out,
            tile_map=tile_map,
        )

    def _fixed_grid_forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every launch's grid fixed by the metadata's shapes, not by the step's mix (a mixed step's CUDA graph):
        decode over all `num_decodes` rows (rows past the real decodes have seq_len 0 and write zeros), then prefill
        over all of q through the tile map (absolute query starts), which overwrites the chunk rows among them.

        NOTE: zeros, not empty: padding rows past the last chunk are written by neither kernel.
        """
        assert meta.prefill_tile_map is not None
        out = torch.zeros_like(q)
        nd = meta.num_decodes
        if nd > 0:
            self._decode(q[:nd], k_cache, v_cache, meta, out[:nd])
        self._prefill(q, k_cache, v_cache, meta, out, tile_map=meta.prefill_tile_map)
        return out
