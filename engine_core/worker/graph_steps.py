"""The CUDA-graph step functions a runner on a GPU uses (Triton backend, not enforce_eager): decode-only steps
(cuda_graphs.py) and steps with prefill chunks (mixed_graphs.py), with the Triton kernels' split choice per size;
their capture once the KV cache is allocated."""

from __future__ import annotations

import importlib
import time

import structlog
import torch

from engine_core.model.llama import LlamaForCausalLM
from engine_core.worker.cuda_graphs import CudaGraphDecodeStep, capture_sizes
from engine_core.worker.mixed_graphs import CudaGraphMixedStep, token_buckets
from engine_core.worker.step_functions import StepFunction

log = structlog.get_logger(__name__)


def cuda_graph_steps(
    model: LlamaForCausalLM,
    device: torch.device,
    max_num_seqs: int,
    max_tokens: int,
    max_blocks_per_seq: int,
    max_model_len: int,
    num_kv_heads: int,
) -> tuple[CudaGraphDecodeStep, CudaGraphMixedStep]:
    triton_kernels = importlib.import_module("kernels.triton")  # NOTE: CUDA only; the CPU engine imports no Triton
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def num_splits(rows: int) -> int:
        return triton_kernels.choose_num_splits(rows, num_kv_heads, max_model_len, sms)

    decode = CudaGraphDecodeStep(
        model, capture_sizes(max_num_seqs), max_blocks_per_seq, max_model_len, num_splits, device
    )
    mixed = CudaGraphMixedStep(
        model,
        token_buckets(max_tokens),
        max_num_seqs,
        max_blocks_per_seq,
        max_model_len,
        num_splits,
        triton_kernels.prefill_tile_map,
        triton_kernels.prefill_num_tiles,
        device,
    )
    return decode, mixed


def capture_graphs(
    decode_step: StepFunction | None, mixed_step: StepFunction | None, kv_caches: list[torch.Tensor]
) -> None:
    """Captures the runner's CUDA-graph step functions over its allocated KV cache (others have nothing to capture)."""
    if isinstance(decode_step, CudaGraphDecodeStep):
        t0 = time.perf_counter()
        with torch.inference_mode():
            decode_step.capture(kv_caches)
        log.info("CUDA graphs captured", sizes=decode_step.sizes, seconds=round(time.perf_counter() - t0, 2))
    if isinstance(mixed_step, CudaGraphMixedStep):
        t0 = time.perf_counter()
        with torch.inference_mode():
            mixed_step.capture(kv_caches)
        log.info(
            "CUDA graphs captured (mixed steps)",
            token_sizes=mixed_step.sizes,
            seconds=round(time.perf_counter() - t0, 2),
        )
