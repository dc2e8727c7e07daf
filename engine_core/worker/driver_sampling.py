"""Sampling under tensor parallelism: rank 0 (the driver) samples, the other ranks never do (no generator of theirs
advances, so no rank's history can diverge); they receive the driver's tokens by one broadcast, which their
persistent batch feeds back as the next decode inputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine_core.distributed import collectives
from engine_core.distributed.parallel_state import TensorParallel
from engine_core.worker.step_sampling import StepSample


def sample_on_driver(
    tp: TensorParallel,
    rows: int,
    logits: torch.Tensor | None,
    sample: Callable[[torch.Tensor], StepSample],
    device: torch.device,
) -> StepSample:
    """The driver's `sample(logits)`; on the other ranks, a `StepSample` of the driver's tokens alone. `device`: where
    the group's collectives run (NCCL broadcasts CUDA tensors only)."""
    if tp.size == 1:
        assert logits is not None
        return sample(logits)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    result = None
    if tp.is_driver:
        assert logits is not None
        result = sample(logits)
        tokens.copy_(torch.from_numpy(np.asarray(result.tokens, dtype=np.int64)))
    collectives.broadcast_from_driver(tokens)
    return result if result is not None else StepSample(tokens.cpu().numpy(), None)
