"""Engine configuration: one dataclass the LLM API, the CLI and the services all build from.

Every engine default is written here once; the services' flags are derived from these fields
(`services/common/engine_flags.py` reads each field's default and its `help` metadata).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from engine_core.spec_decode.config import SpeculativeConfig

CACHE_ENV = "PAGODA_CACHE"
DEFAULT_CACHE_DIR = "~/.cache/pagoda"


def default_cache_dir() -> str:
    """Where converted weights and built kernels are cached: $PAGODA_CACHE, else ~/.cache/pagoda."""
    return os.path.expanduser(os.environ.get(CACHE_ENV, DEFAULT_CACHE_DIR))


def _opt(default: Any, help: str) -> Any:
    """A field with its flag's help text (the flag name is the field name with dashes)."""
    return field(default=default, metadata={"help": help})


_DTYPES = ("auto", "float32", "bfloat16", "float16")
# NOTE: vLLM's names; its fp8 caches have no CPU kernels here and are refused by name.
_KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
# vLLM's names (int8: quantized per output channel at load; compressed-tensors: a checkpoint already int8 in that
# format, which also runs as int8); None: the checkpoint's own format (gguf for a .gguf model). gguf_a8 (no vLLM
# name: vLLM's CUDA GGUF kernels do this unasked, `ggml_mul_mat_a8`): a .gguf model's 4-bit codes times activations
# quantized to 8 bits per 32-k block, in integer dot products (model/layers/gguf_a8.py).
QUANTIZATIONS = ("gguf", "gguf_a8", "int8", "compressed-tensors")
_POLICIES = ("fcfs", "priority")
_BACKENDS = ("cpu", "torch", "triton")


@dataclass
class EngineConfig:
    """Everything that shapes the engine. Unknown keyword arguments to `LLM(...)` are rejected by name."""

    model: str | None = _opt(None, "HF directory or .gguf file (default SmolLM2-135M-Instruct)")
    tokenizer: str | None = _opt(None, "tokenizer directory (default: the model's)")
    # NOTE: bfloat16 on CUDA runs the matmuls and the attention dots on tensor cores. On CPU it runs the GEMMs with
    # bf16 weights (AVX-512 BF16 / AMX; activations float32, model/layers/cpu_bfloat16.py); float32 stays the CPU
    # default, exact (docs/decisions.md, "CPU kernels").
    dtype: str = _opt("auto", "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16")
    # NOTE: a .gguf model is computed from its codes whether or not this says gguf (the codes give float32's bits);
    # naming it makes a non-GGUF model an error at load instead of a silent float32 run.
    # int8 (CPU: model/layers/cpu_int8.py with int8 dot products, cpu_int8_records.py on AVX2 without them; CUDA:
    # layers/cuda_codes.py); float32 stays the default.
    quantization: str | None = _opt(
        None,
        "gguf (default for a .gguf model) | gguf_a8 (a .gguf model on CPU: 8-bit activations, faster, not float32's "
        "bits) | int8 | compressed-tensors; none: the checkpoint's own format",
    )
    device: str = _opt("cpu", "cpu | cuda | cuda:N")
    seed: int = _opt(0, "seed of the shared sampling generator")
    # KV cache
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory: float = _opt(2.0, "GiB of KV cache on CPU")
    gpu_memory_utilization: float = _opt(0.85, "fraction of free GPU memory given to the KV cache")
    # NOTE: overrides both budgets (tests use it to force preemption).
    num_kv_blocks: int | None = _opt(None, "fixed KV block count (skips profiling)")
    kv_cache_dtype: str = _opt("auto", "auto (the model's dtype where attention reads it) | bfloat16 | float32")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prefixes")
    # Scheduler
    max_model_len: int | None = _opt(None, "context limit (default: the model's, capped at 8192)")
    max_num_batched_tokens: int = _opt(2048, "tokens per step")
    max_num_seqs: int = _opt(128, "sequences per step (rows of the worker's persistent batch)")
    scheduling_policy: str = _opt("fcfs", "fcfs | priority")
    # NOTE: only executors that can run a step while the scheduler goes on (remote workers) use it; offline LLM runs
    # the model on the scheduler's own thread.
    async_scheduling: bool = _opt(True, "plan step N+1 while the workers run a short step N (remote workers)")
    # NOTE: llguidance's fuel bounds a compile's work, not its wall time on a loaded machine: this bounds the wait of
    # a structured-output request whose grammar the worker is compiling (core/grammar_gate.py). No vLLM equivalent.
    structured_outputs_compile_timeout: float = _opt(
        30.0, "seconds a structured-output request waits for its grammar to compile before it fails alone"
    )
    # NOTE: a dict (LLM) or JSON (flags) becomes the typed SpeculativeConfig in __post_init__, as vLLM's keys.
    speculative_config: SpeculativeConfig | None = field(
        default=None,
        metadata={"help": 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\''},
    )
    # Model execution
    attention_backend: str | None = _opt(None, "cpu | torch | triton (default: by device)")
    enforce_eager: bool = _opt(False, "no CUDA graphs: decode steps launch every kernel (CUDA + triton backend only)")
    num_threads: int | None = _opt(
        None, "torch intra-op threads on CPU, per rank (default: torch's, capped by the rank's share of a CPU limit)"
    )
    # NOTE: vLLM's name. The model is split over this many ranks (engine_core/distributed): the offline LLM starts
    # ranks 1.. as processes of its own; the services run one worker per rank.
    tensor_parallel_size: int = _opt(1, "ranks the model is split over (attention heads, MLP columns, vocabulary)")
    cache_dir: str = field(default_factory=default_cache_dir, metadata={"help": f"${CACHE_ENV}"})

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.validate()

    def validate(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization == "gguf_a8" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization='gguf_a8' runs float32 activations; dtype={self.dtype!r} cannot go with it")
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
        if not 0 < self.structured_outputs_compile_timeout < math.inf:
            raise ValueError(
                "structured_outputs_compile_timeout must be a finite number of seconds > 0, "
                f"got {self.structured_outputs_compile_timeout}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            # NOTE: the draft model is not sharded: it would run whole on every rank.
            raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size 1 only")
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
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def resolved_kv_cache_dtype(
        self, compute_dtype: str, model_dtype: str | None = None, cache_dtypes: tuple[str, ...] = ()
    ) -> str:
        """The KV cache's dtype when attention computes in `compute_dtype` and its backend also reads a cache in
        `cache_dtypes`; "auto" is `model_dtype` (the GEMMs' dtype, as vLLM's "auto") where the backend reads it.

        NOTE: CUDA's kernels read their compute dtype only (no cast on load); the CPU's native kernels also read a
        bf16 cache under fp32 attention, so on CPU dtype="bfloat16" gives a bf16 cache and float32 one flag away.
        """
        readable = (compute_dtype, *cache_dtypes)
        if self.kv_cache_dtype == "auto":
            return model_dtype if model_dtype in readable else compute_dtype
        kv = self.kv_cache_dtype
        if kv not in readable:
            raise ValueError(
                f"kv_cache_dtype={kv!r} needs attention in {kv}, but it computes in {compute_dtype} here with no "
                f"kernel that reads a {kv} cache (dtype={self.dtype!r} on {self.device}); use kv_cache_dtype='auto'"
            )
        return kv

    @property
    def resolved_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "cpu"
