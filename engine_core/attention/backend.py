"""The attention-backend interface: the model calls `backend.forward(...)` and never knows which backend runs.

The implementations (`torch_backend`, `cpu_backend`, `triton_backend`) import this module; the choice among them is
`selector.create_backend`, which imports them: the imports only point down, never in a circle.

Batch layout (built by the model runner once per step, shared by all layers):
- tokens are flattened; the `num_decodes` decode sequences (one query token each) come first, then the
  `num_prefills` prefill/extend chunks (one or more query tokens each, their K/V context in the cache).
- `slot_mapping[t] = block_id * block_size + offset` is where token t's K/V is written; -1 means "skip" (padding).
- KV cache per layer: one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_decodes: int
    num_prefills: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    # Decode part (rows 0..num_decodes-1)
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length including the new token
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    max_decode_seq_len: int
    # Prefill part (query tokens after the decode tokens)
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, cu_seqlens of queries (prefill-relative)
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context length after this chunk
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    max_prefill_query_len: int
    # Host copies for backends that loop over prefill chunks on the CPU.
    prefill_query_lens_cpu: list[int]
    prefill_seq_lens_cpu: list[int]
    # Split-K count of the Triton decode kernel; None = chosen per step from max_decode_seq_len. A CUDA graph fixes it
    # at capture (engine_core/worker/cuda_graphs.py).
    decode_num_splits: int | None = None
    # The fixed-grid layout of a mixed step's CUDA graph (engine_core/worker/mixed_graphs.py); None = the layout above.
    # When set: `prefill_query_start_loc` is absolute (it counts the decode rows), chunks past the real ones are
    # empty, decode rows past the real ones have seq_len 0, rows past the last chunk are padding, and the Triton
    # prefill kernel takes its grid from this `[num_tiles, 2]` (chunk, query block) map.
    prefill_tile_map: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Writes this step's K/V into the paged cache, then attends through the block tables."""

    name: str
    # KV cache dtypes this backend reads besides the dtype it computes in (kv_cache_dtype; config.py)
    cache_dtypes: tuple[str, ...] = ()

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = scale

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the first layer: a place for per-step work shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
