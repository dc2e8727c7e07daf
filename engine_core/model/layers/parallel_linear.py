"""Tensor-parallel linears (vLLM's / nano-vllm's ColumnParallel, QKV, MergedColumn and RowParallel layers): each is a
`Linear` over this rank's slice of the checkpoint weight, so every `LinearMethod` (float32 forms, GGUF codes, bf16)
packs and multiplies the slice as it would a whole weight.

- column-parallel (QKV, gate/up): the rank holds a slice of each fused shard's output rows; its output is this rank's
  heads / intermediate columns, no communication;
- row-parallel (o_proj, down_proj): the rank holds a slice of the input columns; the partial products are summed
  over the ranks with one all-reduce.

NOTE: a GGUF weight is decoded to float32 before it is sliced, and the GGUF codes method re-finds the codes from the
slice: a row slice of Q4_1 codes is whole rows of blocks, a column slice is whole blocks when the rank's input width
is a multiple of 32 (SmolLM2: 576/3 and 1536/3); otherwise that layer keeps float32 forms (exact, larger).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engine_core.distributed import collectives
from engine_core.distributed.parallel_state import SINGLE, TensorParallel, kv_heads_per_rank
from engine_core.model.layers.block_codes import BlockCodes
from engine_core.model.layers.linear import Linear


class ColumnParallelLinear(Linear):
    """Fused output shards, each split over the ranks: `slices[i]` = (first checkpoint row, rows) of shard i that
    this rank holds (a replicated KV head is the same slice on several ranks)."""

    def __init__(self, in_features: int, slices: Sequence[tuple[int, int]], bias: bool) -> None:
        sizes = [n for _, n in slices]
        super().__init__(in_features, sum(sizes), bias, output_sizes=sizes if len(sizes) > 1 else ())
        self.slices = list(slices)

    @classmethod
    def even(
        cls, in_features: int, output_sizes: Sequence[int], bias: bool, tp: TensorParallel
    ) -> ColumnParallelLinear:
        """Each shard split evenly: rank r holds rows [r * n / size, (r + 1) * n / size) of each."""
        for n in output_sizes:
            if n % tp.size:
                raise ValueError(f"tensor_parallel_size={tp.size} does not divide an output of {n} features")
        return cls(in_features, [(tp.rank * (n // tp.size), n // tp.size) for n in output_sizes], bias)

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None, codes: BlockCodes | None = None
    ) -> None:
        """`codes` (K-quants) come only unsharded (LlamaForCausalLM.load_weights drops them under TP): the slice is
        then the whole tensor."""
        start, rows = self.slices[0 if shard is None else shard]
        super().weight_loader(param, loaded.narrow(0, start, rows), shard, codes)


def qkv_parallel(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TensorParallel
) -> ColumnParallelLinear:
    """Q/K/V fused: num_heads / size query heads per rank; KV heads split likewise, or, with fewer KV heads than
    ranks, KV head `rank // (size / num_kv_heads)` on each rank (replicated, as vLLM's QKVParallelLinear does), so
    each rank's query heads find their group's KV head locally."""
    q_local = num_heads // tp.size
    kv_local = kv_heads_per_rank(num_kv_heads, tp.size)
    kv_first = tp.rank * kv_local if num_kv_heads >= tp.size else tp.rank // (tp.size // num_kv_heads)
    q = (tp.rank * q_local * head_dim, q_local * head_dim)
    kv = (kv_first * head_dim, kv_local * head_dim)
    return ColumnParallelLinear(hidden, [q, kv, kv], bias)


class RowParallelLinear(Linear):
    """The rank holds input columns [rank * in / size, (rank + 1) * in / size); the output is summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel = SINGLE) -> None:
        if in_features % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} does not divide an input of {in_features} features")
        super().__init__(in_features // tp.size, out_features, bias=False)
        self.tp = tp

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None, codes: BlockCodes | None = None
    ) -> None:
        width = self.in_features
        super().weight_loader(param, loaded.narrow(1, self.tp.rank * width, width), shard, codes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return collectives.all_reduce(y) if self.tp.size > 1 else y
