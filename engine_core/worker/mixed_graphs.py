"""CUDA graphs for steps that carry prefill chunks ("mixed" steps): the whole forward replayed as one launch.

NOTE: measured on an H100 (`benchmarks/step_profile.py`, SmolLM2-135M shapes, bf16, 1,024 requests):
the 395 steps that carried a prefill chunk ran eagerly, host-bound, ~25 ms each (a Triton launch costs ~55 us of
host time through triton's Python launcher, ~240 of them per step, plus the GEMMs); one such step of 2,048 tokens
took 28.9 ms to launch and 2.8 ms on the GPU when replayed as one graph. Decode-only steps already replayed graphs
(cuda_graphs.py). Piecewise graphs (attention eager between captured pieces) would have kept ~4 Triton launches per
layer on the host; here the attention is graph-safe instead, so nothing of the forward is launched per step.

Graphs freeze shapes, addresses and kernel grids, so:
- token counts are bucketed (`token_buckets`): a step of n tokens runs the graph of the smallest bucket T >= n, rows
  past n are padding (slot -1: no K/V written; attention output zeros) and only the first n rows are used;
- attention runs in the fixed-grid layout (`AttentionMetadata.prefill_tile_map`, attention/triton_backend.py): a
  bucket of T tokens has room for C = min(T, max_num_seqs) decode rows and C prefill chunks; decode rows past the
  real ones have seq_len 0, chunks past the real ones are empty, and the prefill kernel's (chunk, query block) map is
  recomputed inside the graph from the query starts (kernels/triton/prefill_attention.py: `prefill_tile_map`);
- the step's inputs (already on the device) are copied into static buffers before each replay; block tables keep
  their full width; the decode split count is frozen per bucket, as for decode graphs.
Steps of more tokens than the largest bucket run eagerly. The bucketing and padding are plain tensor code, run
without capture on CPU in the tests (tests/test_mixed_graphs.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.worker.cuda_graphs import BucketedGraphs, Forward, bucket_for

TileMap = Callable[[torch.Tensor, int], torch.Tensor]  # (query_start_loc, num_tiles) -> [num_tiles, 2] int32
NumTiles = Callable[[int, int], int]  # (max_tokens, max_chunks) -> tile map length


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets: 16, 32, 64, 128, then every 256 up to 2048, then every 1024, and `max_tokens` itself.

    NOTE: the padding is GEMM work on rows nobody reads: at most 255 rows above 256 tokens (<= 1/9 of a 2,048-token
    step), few enough graphs (12 up to 2,048 tokens) that capture takes seconds.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = {s for s in (16, 32, 64, 128) if s < max_tokens}
    sizes |= set(range(256, min(max_tokens, 2048) + 1, 256))
    sizes |= set(range(3072, max_tokens + 1, 1024))
    return sorted(sizes | {max_tokens})


class CudaGraphMixedStep(BucketedGraphs):
    """The step function for steps with prefill chunks: one captured forward per token bucket.

    `forward` is the model (the layer loop); `num_splits(rows)` the decode split count frozen into a bucket with
    room for `rows` decode rows; `tile_map` / `num_tiles` the Triton prefill kernel's tiling (`kernels.triton`
    passes `prefill_tile_map` / `prefill_num_tiles`: CUDA only, so they come in from the runner).
    """

    def __init__(
        self,
        forward: Forward,
        sizes: list[int],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        num_splits: Callable[[int], int],
        tile_map: TileMap,
        num_tiles: NumTiles,
        device: torch.device,
    ) -> None:
        super().__init__(forward, sizes, max(sizes), device)
        self._max_num_seqs = max_num_seqs
        self._max_seq_len = max_seq_len
        self._num_splits = num_splits
        self._tile_map = tile_map
        self._num_tiles = num_tiles
        seqs = max_num_seqs
        i32 = {"dtype": torch.int32, "device": device}
        self.decode_seq_lens = torch.zeros(seqs, **i32)
        self.decode_block_tables = torch.zeros(seqs, max_blocks_per_seq, **i32)
        self.prefill_seq_lens = torch.zeros(seqs, **i32)
        self.prefill_block_tables = torch.zeros(seqs, max_blocks_per_seq, **i32)
        self.query_start_loc = torch.zeros(seqs + 1, **i32)

    def rows(self, size: int) -> int:
        """Decode rows, and prefill chunks, that bucket `size` has room for."""
        return min(size, self._max_num_seqs)

    def static_metadata(self, size: int) -> AttentionMetadata:
        """Fixed-grid metadata over the static buffers of bucket `size`, its tile map computed from them now (inside
        a capture: on every replay)."""
        c = self.rows(size)
        meta = AttentionMetadata(
            num_decodes=c,
            num_prefills=c,
            slot_mapping=self.slot_mapping[:size],
            decode_seq_lens=self.decode_seq_lens[:c],
            decode_block_tables=self.decode_block_tables[:c],
            max_decode_seq_len=self._max_seq_len,
            prefill_query_start_loc=self.query_start_loc[: c + 1],
            prefill_seq_lens=self.prefill_seq_lens[:c],
            prefill_block_tables=self.prefill_block_tables[:c],
            max_prefill_query_len=size,
            prefill_query_lens_cpu=[],
            prefill_seq_lens_cpu=[],
            decode_num_splits=self._num_splits(c),
        )
        tiles = self._tile_map(meta.prefill_query_start_loc, self._num_tiles(size, c))
        return dataclasses.replace(meta, prefill_tile_map=tiles)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """Copies a step (eager layout) into the static buffers in the fixed-grid layout, padding past it; returns
        the bucket, or None when the step is larger than every bucket.

        NOTE: token ids and positions of padding rows keep stale values (valid ids and positions of earlier steps):
        every op but attention is row by row, and attention reads no padding row, so they reach no real row.
        """
        n, nd, np_ = meta.num_tokens, meta.num_decodes, meta.num_prefills
        size = bucket_for(n, self.sizes)
        if size is None or max(nd, np_) > self.rows(size):
            return None
        end = nd + sum(meta.prefill_query_lens_cpu)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)  # no K/V written
        if nd:
            self.decode_seq_lens[:nd].copy_(meta.decode_seq_lens, non_blocking=True)
            self.decode_block_tables[:nd, : meta.decode_block_tables.shape[1]].copy_(meta.decode_block_tables)
        self.decode_seq_lens[nd : self.rows(size)].zero_()  # decode rows past the real ones read nothing
        if np_:
            self.prefill_seq_lens[:np_].copy_(meta.prefill_seq_lens, non_blocking=True)
            self.prefill_block_tables[:np_, : meta.prefill_block_tables.shape[1]].copy_(meta.prefill_block_tables)
        # Absolute query starts (after the decode rows); chunks past the real ones are empty (no tiles, never read).
        torch.add(meta.prefill_query_start_loc, nd, out=self.query_start_loc[: np_ + 1])
        self.query_start_loc[np_ + 1 : self.rows(size) + 1].fill_(end)
        return size

    def pad_all(self) -> None:
        # No K/V written, no decode row, no chunk.
        self.slot_mapping.fill_(-1)
        self.decode_seq_lens.zero_()
        self.query_start_loc.zero_()

    def used_rows(self, meta: AttentionMetadata) -> int:
        return meta.num_tokens
