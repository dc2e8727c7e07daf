"""The vocabulary split over the tensor-parallel ranks: the embedding (each rank looks up the ids in its part, the
rows summed with one all-reduce) and the LM head (each rank's logits for its part, gathered to rank 0 only, and only
for the rows the caller passes: the sampled ones).

Rank r holds vocabulary rows [r * part, (r + 1) * part), part = ceil(vocab / size); the last part is zero-padded, and
the padded logits are cut off after the gather.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.distributed import collectives
from engine_core.distributed.parallel_state import TensorParallel
from engine_core.model.layers.block_codes import BlockCodes
from engine_core.model.layers.linear import Linear


def vocab_part(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the vocabulary on this rank, padding included."""
    part = -(-vocab_size // tp.size)
    return tp.rank * part, part


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, first: int) -> None:
    """This rank's vocabulary rows of `loaded` into `param`, the rows past the vocabulary zeroed."""
    rows = max(0, min(param.shape[0], loaded.shape[0] - first))
    if loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"checkpoint tensor of shape {list(loaded.shape)} for rows of {list(param.shape[1:])}")
    param.data[:rows].copy_(loaded[first : first + rows])
    param.data[rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first, part = vocab_part(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(part, hidden_size), requires_grad=False)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        _load_rows(param, loaded, self.first)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return collectives.all_reduce(h)


class ParallelLMHead(Linear):
    """A column-parallel `Linear` over this rank's vocabulary part (tied: the embedding's parameter itself)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        self.first, part = vocab_part(vocab_size, tp)
        super().__init__(hidden_size, part, bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    @torch.no_grad()
    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None, codes: BlockCodes | None = None
    ) -> None:
        """`codes` is None here: a vocabulary part is cut from the values (load_weights drops codes under TP)."""
        _load_rows(param, loaded, self.first)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits `[rows, vocab]` on rank 0; None on the others."""
        gathered = collectives.gather_last_dim(self(hidden).float(), self.tp.rank, self.tp.size)
        if gathered is None or gathered.shape[-1] == self.vocab_size:
            return gathered
        return gathered[:, : self.vocab_size].contiguous()
