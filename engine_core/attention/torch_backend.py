"""CPU attention in batched torch: decode rows in a few SDPA calls (by length group), prefill chunks one call each."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_core.attention.backend import AttentionBackend, AttentionMetadata
from engine_core.attention.torch_prefill import GatherWorkspace, TorchPrefill, additive_mask


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of the step, padded to `num_blocks` blocks; `mask` is additive [b, 1, 1, L]."""

    start: int
    end: int
    num_blocks: int
    mask: torch.Tensor


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, scale)
        self._workspace = GatherWorkspace(block_size, num_kv_heads, head_dim)
        self._prefill = TorchPrefill(num_kv_heads, head_dim, block_size, scale)
        self._decode_groups: list[DecodeGroup] = []
        self._mask_dtype = torch.float32
        self._has_padding = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step state shared by all layers: masks and the gather workspace."""
        self._has_padding = bool((meta.slot_mapping < 0).any()) if meta.num_tokens else False
        self._decode_groups = self._plan_decode_groups(meta)
        self._mask_dtype = torch.float32
        self._workspace.needed_blocks = max(
            max(((g.end - g.start) * g.num_blocks for g in self._decode_groups), default=0),
            self._prefill.prepare(meta),
        )

    def _plan_decode_groups(self, meta: AttentionMetadata) -> list[DecodeGroup]:
        """Decode rows split into a few length groups, each with its padding mask (what `_decode` gathers by)."""
        if not meta.num_decodes:
            return []
        groups = []
        lens = meta.decode_seq_lens.tolist()
        # NOTE: decode rows arrive sorted by length (longest first); a few equal-count groups, each padded only
        # to its own longest row, waste far less than padding the whole batch to the longest context.
        n_groups = min(4, max(1, len(lens) // 8))
        bounds = [len(lens) * g // n_groups for g in range(n_groups + 1)]
        for start, end in itertools.pairwise(bounds):
            num_blocks = -(-max(lens[start:end]) // self.block_size)
            pos = torch.arange(num_blocks * self.block_size, device=meta.decode_seq_lens.device)
            valid = pos[None, :] < meta.decode_seq_lens[start:end, None].to(pos.dtype)
            groups.append(DecodeGroup(start, end, num_blocks, additive_mask(valid)[:, None, None, :]))
        return groups

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self._store(k, v, kv_cache, meta)
        if self._mask_dtype != q.dtype:  # masks are built in fp32; cast once per step, not per layer
            for g in self._decode_groups:
                g.mask = g.mask.to(q.dtype)
            self._prefill.cast_masks(q.dtype)
            self._mask_dtype = q.dtype
        out = torch.empty_like(q)
        ws = self._workspace.buffer(kv_cache)
        nd = meta.num_decodes
        if nd:
            self._decode(q[:nd], kv_cache, meta, ws, out[:nd])
        if meta.num_prefills:
            self._prefill.forward(q[nd:], kv_cache, meta, ws, out[nd:])
        end = nd + sum(meta.prefill_query_lens_cpu)
        if end < out.shape[0]:
            out[end:].zero_()  # padding rows belong to no sequence
        return out

    def _store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping
        if self._has_padding:
            keep = slots >= 0
            k, v, slots = k[keep], v[keep], slots[keep]
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, ws: torch.Tensor, out: torch.Tensor
    ) -> None:
        for g in self._decode_groups:
            b = g.end - g.start
            k, v = GatherWorkspace.gather(
                kv_cache, meta.decode_block_tables[g.start : g.end, : g.num_blocks].reshape(-1).long(), ws
            )
            length = g.num_blocks * self.block_size
            k = k.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[g.start : g.end].unsqueeze(2), k, v, attn_mask=g.mask, scale=self.scale, enable_gqa=True
            )
            out[g.start : g.end] = o.squeeze(2)
