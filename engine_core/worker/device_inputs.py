"""A step's inputs on the model's device: persistent device tensors filled from pinned host buffers.

On CUDA, `torch.from_numpy(a).to("cuda")` copies from pageable memory: the copy is synchronous for the host (it waits
for everything already queued on the stream, e.g. the previous forward) and goes through a bounce buffer. Here each
input has one pinned host buffer and one device tensor, both sized for the largest step, allocated once; a step
writes its numpy arrays into the pinned buffers and queues `non_blocking` copies into the device tensors, so the host
never waits for the GPU while it prepares a step. The device tensors keep their addresses for the engine's lifetime,
which is also what a CUDA graph needs of its inputs (engine_core/worker/cuda_graphs.py).

On CPU there is nothing to copy: `put` returns the numpy array as a tensor (padded when asked), unless
`persistent=True` asks for the same fixed tensors as on CUDA (the CUDA-graph padding is tested that way on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class InputSpec:
    """One input: its name, dtype and largest shape (the first dim is what a step fills)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def step_input_specs(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> list[InputSpec]:
    """The model runner's step inputs (names as in `AttentionMetadata`), at their largest."""
    i32, i64 = torch.int32, torch.int64
    return [
        InputSpec("input_ids", i64, (max_tokens,)),
        InputSpec("positions", i64, (max_tokens,)),
        InputSpec("slot_mapping", i64, (max_tokens,)),
        InputSpec("sample_index", i64, (max_tokens,)),  # NOTE: tokens: a verified row samples 1 + k positions
        InputSpec("decode_seq_lens", i32, (max_seqs,)),
        InputSpec("decode_block_tables", i32, (max_seqs, max_blocks_per_seq)),
        InputSpec("prefill_query_start_loc", i32, (max_seqs + 1,)),
        InputSpec("prefill_seq_lens", i32, (max_seqs,)),
        InputSpec("prefill_block_tables", i32, (max_seqs, max_blocks_per_seq)),
    ]


class DeviceInputs:
    def __init__(self, device: torch.device, specs: list[InputSpec], persistent: bool | None = None) -> None:
        self.device = device
        self.staged = device.type == "cuda"  # pinned host buffers + asynchronous copies
        self.persistent = self.staged if persistent is None else persistent or self.staged
        self._specs = {s.name: s for s in specs}
        self._host: dict[str, torch.Tensor] = {}
        self._dev: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None
        for s in specs if self.persistent else []:
            self._dev[s.name] = torch.zeros(s.shape, dtype=s.dtype, device=device)
            if self.staged:
                self._host[s.name] = torch.zeros(s.shape, dtype=s.dtype, pin_memory=True)
        if self.staged:
            self._copied = torch.cuda.Event()

    def begin(self) -> None:
        """Before the first `put` of a step: the previous step's copies must have left the pinned buffers.

        NOTE: a step that samples nothing (a prefill chunk mid-prompt) never syncs with the GPU, so without this wait
        the next step could overwrite a pinned buffer whose copy is still queued. The copies were queued first in the
        previous step, so by now they are almost always done and the wait costs nothing.
        """
        if self._copied is not None:
            self._copied.synchronize()

    def end(self) -> None:
        """After the last `put` of a step: marks the point `begin` waits for."""
        if self._copied is not None:
            self._copied.record()

    def put(self, name: str, values: np.ndarray, pad_to: int | None = None, pad_value: int = 0) -> torch.Tensor:
        """`values` (first dim n) on the device as the first `pad_to or n` rows of `name`'s tensor; rows past n are
        `pad_value`. Returns the device view (valid until the next step's `put` of the same name)."""
        spec = self._specs[name]
        n = values.shape[0]
        m = n if pad_to is None else pad_to
        if m < n or m > spec.shape[0]:
            raise ValueError(f"{name}: {n} rows padded to {m} do not fit its {spec.shape[0]} rows")
        if self.persistent and values.shape[1:] != spec.shape[1:]:
            raise ValueError(f"{name}: rows of shape {values.shape[1:]}, expected {spec.shape[1:]}")
        if not self.persistent:
            t = torch.from_numpy(np.ascontiguousarray(values)).to(spec.dtype)
            if m > n:
                t = torch.cat([t, torch.full((m - n, *spec.shape[1:]), pad_value, dtype=spec.dtype)])
            return t
        if not self.staged:  # persistent CPU tensors: fill in place
            dev_np = self._dev[name][:m].numpy()
            dev_np[:n] = values
            dev_np[n:] = pad_value
            return self._dev[name][:m]
        host = self._host[name][:m]
        host_np = host.numpy()
        host_np[:n] = values
        host_np[n:] = pad_value
        dev = self._dev[name][:m]
        dev.copy_(host, non_blocking=True)
        return dev
