"""What a model runner settles before and around loading its model: the dtypes it computes and stores in, its CPU
thread team, the context length it serves, and what the scheduler needs to know of the model (`ModelInfo`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine_core.config import EngineConfig
from engine_core.distributed.parallel_state import TensorParallel
from engine_core.host_cpus import usable_cpus
from engine_core.model.layers.cpu_bfloat16 import cpu_bf16_gemms
from engine_core.model.loader import DTYPES

GIB = 1 << 30


@dataclass
class ModelInfo:
    """What the scheduler and the frontend need to know about the loaded model."""

    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int  # bytes one KV block takes across all layers


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def runner_dtypes(config: EngineConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(activations and non-GEMM weights, the linears' weights)."""
    dtype = DTYPES[config.resolved_dtype]
    if device.type == "cpu" and dtype == torch.bfloat16:
        # NOTE: bf16 on CPU is bf16 weights in oneDNN's GEMMs, activations float32 (model/layers/cpu_bfloat16.py);
        # a CPU without AVX-512 BF16 / AMX runs float32 (logged).
        return torch.float32, torch.bfloat16 if cpu_bf16_gemms() else torch.float32
    return dtype, dtype


def set_cpu_threads(config: EngineConfig, tp: TensorParallel) -> None:
    """By default torch's team, no larger than a container's CPU limit (host_cpus.py) shared by the ranks; a team
    size the user chose (num_threads, OMP_NUM_THREADS) is kept."""
    threads = config.num_threads or torch.get_num_threads()
    if not config.num_threads and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, min(threads, usable_cpus() // tp.size))  # a rank's share of the cores
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def resolve_max_model_len(config: EngineConfig, hf_config: object) -> int:
    limit = int(getattr(hf_config, "max_position_embeddings", 8192))
    # NOTE: no sliding-window attention: a window caps the context we can serve exactly.
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, int(window))
    if config.max_model_len is None:
        return min(limit, 8192)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's limit ({limit})")
    return config.max_model_len
