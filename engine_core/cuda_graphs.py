"""CUDA graphs for decode-only steps: the whole forward (every layer's kernels) replayed as one launch.

A decode step of a small model is launch bound: ~30 layers x ~15 kernels, each a few microseconds of GPU work and
as much host time to launch. A captured graph replays them all from one host call. Graphs freeze shapes and
addresses, so:

- batch sizes are bucketed (`capture_sizes`): a step of n sequences runs the graph of the smallest bucket >= n, its
  rows past n padded as empty sequences (token 0, position 0, slot -1: no K/V written; seq_len 0: attention reads
  nothing and returns zeros), and only the first n rows of the output are used;
- inputs live in persistent device tensors (`DeviceInputs`), refilled before each replay; block tables keep their
  full `max_blocks_per_seq` width, so their stride never changes;
- the decode kernel's split count is fixed per bucket at capture (its grid is frozen), chosen for the longest
  context the engine serves; it is correct for any shorter one (kernels/triton/decode_attention.py).

Capture itself runs only on CUDA; the bucketing and padding are plain host code, tested on CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.device_inputs import DeviceInputs

# Graph-step inputs, by the names `DeviceInputs` holds them under.
GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "decode_seq_lens", "decode_block_tables")


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


def graph_metadata(inputs: DeviceInputs, size: int, max_seq_len: int, num_splits: int) -> AttentionMetadata:
    """Decode-only metadata over the first `size` rows of the persistent input tensors."""
    dev = inputs.device
    empty_i32 = torch.zeros(0, dtype=torch.int32, device=dev)
    return AttentionMetadata(
        num_decodes=size,
        num_prefills=0,
        slot_mapping=inputs.device_tensor("slot_mapping")[:size],
        decode_seq_lens=inputs.device_tensor("decode_seq_lens")[:size],
        decode_block_tables=inputs.device_tensor("decode_block_tables")[:size],
        max_decode_seq_len=max_seq_len,
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev),
        prefill_seq_lens=empty_i32,
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=dev),
        max_prefill_query_len=0,
        prefill_query_lens_cpu=[],
        prefill_seq_lens_cpu=[],
        decode_num_splits=num_splits,
    )


class CudaGraphDecode:
    """One captured forward per bucket size; `replay(size)` runs it over whatever the input tensors now hold."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        inputs: DeviceInputs,
        sizes: list[int],
        max_seq_len: int,
        num_splits: Callable[[int], int],
    ) -> None:
        self.inputs = inputs
        self.sizes = sizes
        self._forward = forward
        self._max_seq_len = max_seq_len
        self._num_splits = num_splits
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        """Captures every bucket, largest first (later, smaller graphs reuse its memory pool)."""
        pool = None
        for size in sorted(self.sizes, reverse=True):
            meta = graph_metadata(self.inputs, size, self._max_seq_len, self._num_splits(size))
            ids = self.inputs.device_tensor("input_ids")[:size]
            pos = self.inputs.device_tensor("positions")[:size]
            # Padding everywhere before capture: the warm-up runs must not touch the KV cache.
            ids.zero_()
            pos.zero_()
            meta.slot_mapping.fill_(-1)
            meta.decode_seq_lens.zero_()
            # NOTE: warm-up on a side stream compiles the Triton kernels and lets the allocator settle, as
            # torch.cuda.graphs documents; nothing may compile or allocate fresh memory during capture.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(ids, pos, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._forward(ids, pos, meta)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int, n: int) -> torch.Tensor:
        """Runs bucket `size`'s graph; returns the first n rows of its (static) output."""
        self._graphs[size].replay()
        return self._outputs[size][:n]
