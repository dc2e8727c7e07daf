"""CUDA graphs for decode-only steps: the whole forward (every layer's kernels) replayed as one launch.

A decode step of a small model is launch bound: ~30 layers x ~15 kernels, each a few microseconds of GPU work and
as much host time to launch. A captured graph replays them all from one host call. Graphs freeze shapes and
addresses, so:

- batch sizes are bucketed (`capture_sizes`): a step of n sequences runs the graph of the smallest bucket >= n, its
  rows past n padded as empty sequences (token 0, position 0, slot -1: no K/V written; seq_len 0: attention reads
  nothing and returns zeros), and only the first n rows of the output are used;
- inputs live in static device tensors owned by the step function, refilled (device to device, a handful of small
  copies) from the step's own inputs before each replay; block tables keep their full `max_blocks_per_seq` width, so
  their stride never changes;
- the decode kernel's split count is fixed per bucket at capture (its grid is frozen), chosen for the longest
  context the engine serves; it is correct for any shorter one (kernels/triton/decode_attention.py).

`CudaGraphDecodeStep` is a step function (step_functions.py): the runner picks it for decode-only steps.
Capture itself runs only on CUDA; the bucketing and padding are plain tensor code, tested on CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from engine_core.attention.backend import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, then every multiple of 8, up to and including `max_num_seqs`.

    NOTE: at most 7 padded rows per step beyond 8 (cheap next to a launch-bound step), and few enough graphs that
    capture takes seconds; the same scheme as vLLM's.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes)


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds n rows; None when n exceeds the largest (the step then runs eagerly)."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def capture_graph(run: Callable[[], torch.Tensor], pool: object = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` captured as a CUDA graph (in memory pool `pool`, if given); returns the graph and `run`'s output tensor,
    which every replay rewrites in place.

    NOTE: warm-up on a side stream compiles the Triton kernels and settles the allocator, as torch.cuda graphs
    require: nothing may compile or synchronize during capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]


class BucketedGraphs:
    """One captured forward per bucket over static input buffers, replayed for steps that fit a bucket.

    The shared half of the decode-only (`CudaGraphDecodeStep`) and mixed (`mixed_graphs.CudaGraphMixedStep`) step
    functions. A subclass owns its layout: `fill` copies a step into the static buffers (returning its bucket, or
    None to run `forward` eagerly), `static_metadata` describes a bucket over them, `pad_all` marks every row as
    padding (no K/V written) for the warm-up and capture runs, and `used_rows` says how many output rows are real.
    """

    def __init__(self, forward: Forward, sizes: list[int], max_tokens: int, device: torch.device) -> None:
        self.sizes = sizes
        self._forward = forward
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.full((max_tokens,), -1, **i64)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._kv_caches: list[torch.Tensor] | None = None

    def static_metadata(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int | None:
        raise NotImplementedError

    def pad_all(self) -> None:
        raise NotImplementedError

    def used_rows(self, meta: AttentionMetadata) -> int:
        raise NotImplementedError

    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Captures every bucket over `kv_caches` (the runner's, fixed for the engine's lifetime), largest first so
        the smaller graphs reuse its memory pool."""
        self._kv_caches = kv_caches
        pool = None
        self.pad_all()  # the warm-up and captured runs must not write the KV cache
        for size in sorted(self.sizes, reverse=True):
            ids, pos = self.input_ids[:size], self.positions[:size]

            def run(size: int = size, ids: torch.Tensor = ids, pos: torch.Tensor = pos) -> torch.Tensor:
                return self._forward(ids, pos, kv_caches, self.static_metadata(size))

            graph, self._outputs[size] = capture_graph(run, pool)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert kv_caches is self._kv_caches, "the graphs were captured over other KV cache tensors"
        size = self.fill(input_ids, positions, meta)
        if size is None:
            return self._forward(input_ids, positions, kv_caches, meta)
        self._graphs[size].replay()
        return self._outputs[size][: self.used_rows(meta)]


class CudaGraphDecodeStep(BucketedGraphs):
    """The decode-only step function that replays one captured forward per bucket size.

    `forward` is the model (the layer loop); `num_splits(size)` the decode split count frozen into bucket `size`.
    Steps larger than the largest bucket fall back to `forward`.
    """

    def __init__(
        self,
        forward: Forward,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        num_splits: Callable[[int], int],
        device: torch.device,
    ) -> None:
        super().__init__(forward, sizes, max(sizes), device)
        self._max_seq_len = max_seq_len
        self._num_splits = num_splits
        rows = max(sizes)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32, device=device)

    def static_metadata(self, size: int) -> AttentionMetadata:
        """Decode-only metadata over the first `size` rows of the static buffers (what bucket `size` captured)."""
        dev = self.input_ids.device
        i32 = {"dtype": torch.int32, "device": dev}
        return AttentionMetadata(
            num_decodes=size,
            num_prefills=0,
            slot_mapping=self.slot_mapping[:size],
            decode_seq_lens=self.seq_lens[:size],
            decode_block_tables=self.block_tables[:size],
            max_decode_seq_len=self._max_seq_len,
            prefill_query_start_loc=torch.zeros(1, **i32),
            prefill_seq_lens=torch.zeros(0, **i32),
            prefill_block_tables=torch.zeros(0, 1, **i32),
            max_prefill_query_len=0,
            prefill_query_lens_cpu=[],
            prefill_seq_lens_cpu=[],
            decode_num_splits=self._num_splits(size),
        )

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """Copies a decode-only step into the static buffers, rows past it padded as empty sequences; returns the
        bucket, or None when the step is larger than every bucket."""
        n = meta.num_decodes
        size = bucket_for(n, self.sizes)
        if size is None:
            return None
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.decode_seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)  # no K/V written
            self.seq_lens[n:size].zero_()  # attention reads nothing, returns zeros
        return size

    def pad_all(self) -> None:
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()

    def used_rows(self, meta: AttentionMetadata) -> int:
        return meta.num_decodes
