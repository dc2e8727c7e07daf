"""How the model runner runs one step's forward: a step function, picked per step.

Every step function takes `(input_ids, positions, kv_caches, meta)` and returns the final hidden states
`[num_tokens, hidden]`, exactly what the model's own forward (the layer loop) returns. The runner holds:
- `forward`: the model itself (the layer loop), which serves every step;
- `decode_step`: an optional faster function for decode-only steps (`models.native_decode.NativeDecodeStep` on CPU,
  `cuda_graphs.CudaGraphDecodeStep` on CUDA);
- `mixed_step`: an optional faster function for steps that carry prefill chunks (`mixed_graphs.CudaGraphMixedStep`
  on CUDA).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine_core.attention.backend import AttentionMetadata


class StepFunction(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


def is_decode_only(meta: AttentionMetadata) -> bool:
    """Every token of the step is a decode row (one query token per sequence, no prefill chunk, no padding)."""
    return meta.num_prefills == 0 and meta.num_tokens == meta.num_decodes


def pick_step_function(
    forward: StepFunction,
    decode_step: StepFunction | None,
    meta: AttentionMetadata,
    mixed_step: StepFunction | None = None,
) -> StepFunction:
    """The decode step for decode-only steps, the mixed step for steps with a prefill chunk (each where set),
    otherwise the layer loop."""
    if is_decode_only(meta):
        return decode_step if decode_step is not None else forward
    if mixed_step is not None and meta.num_prefills > 0:
        return mixed_step
    return forward
