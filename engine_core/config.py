"""Engine configuration: one dataclass the LLM API, the CLI and the services all build from."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

_DTYPES = ("float32", "bfloat16", "float16")
_POLICIES = ("fcfs", "priority")
_BACKENDS = ("cpu", "torch", "triton")


@dataclass
class EngineConfig:
    """Everything that shapes the engine. Unknown keyword arguments to `LLM(...)` are rejected by name."""

    model: str | None = None  # HF directory, .gguf file, or None for the default SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model's own
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory: float = 2.0  # GiB of KV cache on CPU
    gpu_memory_utilization: float = 0.85  # fraction of free GPU memory given to the KV cache
    num_kv_blocks: int | None = None  # overrides both budgets (tests use it to force preemption)
    enable_prefix_caching: bool = True
    # Scheduler
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings, capped at 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"
    # Model execution
    attention_backend: str | None = None  # "cpu" | "torch" | "triton"; None picks by device
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's default
    cache_dir: str = field(
        default_factory=lambda: os.path.expanduser(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda"))
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend is not None and self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def resolved_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "cpu"
