"""Engine flags (model, dtype, KV cache...) shared by the worker, the scheduler and `pagoda serve`."""

from __future__ import annotations

import argparse

from services.common.flags import add_flag, optional_int, optional_str


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--model", default=None, type=optional_str, help="HF directory or .gguf file (default SmolLM2)")
    add_flag(parser, "--tokenizer", default=None, type=optional_str, help="tokenizer directory (default: the model's)")


def add_worker_engine_flags(parser: argparse.ArgumentParser) -> None:
    """What shapes the model runner and its KV cache."""
    add_flag(parser, "--dtype", default="float32", help="float32 | bfloat16 | float16")
    add_flag(parser, "--device", default="cpu", help="cpu | cuda | cuda:N")
    add_flag(parser, "--block-size", default=16, type=int, help="tokens per KV block")
    add_flag(parser, "--kv-cache-memory", default=2.0, type=float, help="GiB of KV cache on CPU")
    add_flag(parser, "--gpu-memory-utilization", default=0.85, type=float, help="fraction of free GPU memory")
    add_flag(parser, "--max-model-len", default=None, type=optional_int, help="context limit (default: the model's)")
    add_flag(parser, "--attention-backend", default=None, type=optional_str, help="cpu | torch | triton")
    add_flag(parser, "--num-threads", default=None, type=optional_int, help="torch CPU threads")
    add_flag(parser, "--seed", default=0, type=int, help="seed of the shared sampling generator")


def add_scheduler_engine_flags(parser: argparse.ArgumentParser) -> None:
    """What shapes continuous batching (the worker's --max-num-seqs must be at least the scheduler's)."""
    add_flag(parser, "--max-num-seqs", default=128, type=int, help="sequences per step")
    add_flag(parser, "--max-num-batched-tokens", default=2048, type=int, help="tokens per step")
    add_flag(parser, "--scheduling-policy", default="fcfs", help="fcfs | priority")
    add_flag(parser, "--enable-prefix-caching", default=True, type=bool, help="reuse KV blocks of shared prefixes")
    add_flag(parser, "--num-kv-blocks", default=None, type=optional_int, help="override the profiled block count")
