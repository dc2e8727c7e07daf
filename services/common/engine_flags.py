"""Engine flags (model, dtype, KV cache...) derived from `EngineConfig`'s fields: defaults and help written once.

A field `max_num_seqs` becomes `--max-num-seqs` (env `PAGODA_MAX_NUM_SEQS`), with the field's default and its
`help` metadata; `engine_config_from_args` builds the EngineConfig back from the parsed flags.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, fields
from typing import Any

from engine_core.config import EngineConfig
from services.common.flags import add_flag, optional_float, optional_int, optional_str

MODEL_FIELDS = ("model", "tokenizer")
# What shapes the model runner and its KV cache.
WORKER_FIELDS = (
    "dtype", "quantization", "device", "block_size", "kv_cache_memory", "kv_cache_dtype", "gpu_memory_utilization",
    "max_model_len",
    "attention_backend", "enforce_eager", "num_threads", "seed", "max_num_seqs", "num_kv_blocks",
    "tensor_parallel_size",
    "speculative_config",  # NOTE: the worker loads a draft_model method's draft
)  # fmt: skip
# What shapes continuous batching (the worker's --max-num-seqs must be at least the scheduler's).
SCHEDULER_FIELDS = (
    "max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "async_scheduling", "enable_prefix_caching",
    "num_kv_blocks", "speculative_config", "tensor_parallel_size", "structured_outputs_compile_timeout",
)  # fmt: skip

_FIELDS: dict[str, Field[Any]] = {f.name: f for f in fields(EngineConfig)}
_HINTS = typing.get_type_hints(EngineConfig)


def _parser_type(name: str) -> Callable[[str], Any]:
    hint = _HINTS[name]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    parse = getattr(base, "parse", None)
    if parse is not None:
        return json_config(parse)  # a typed config given as JSON (speculative_config)
    if optional:
        return {int: optional_int, float: optional_float, str: optional_str}[base]
    return base


def json_config(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type for a typed config given as JSON: its ValueError becomes the flag's error message."""

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_flag


def field_default(name: str) -> Any:
    """EngineConfig's default for a field (the launcher and CLI read defaults here too)."""
    f = _FIELDS[name]
    return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Adds one flag per EngineConfig field in `names` (services.common.flags.add_flag semantics)."""
    for name in names:
        add_flag(
            parser,
            flag_name(name),
            default=field_default(name),
            type=_parser_type(name),
            help=_FIELDS[name].metadata.get("help", ""),
        )


def engine_config_from_args(args: argparse.Namespace, names: Sequence[str], **overrides: Any) -> EngineConfig:
    """The EngineConfig of the parsed flags in `names` (other fields keep their defaults); ValueError if invalid."""
    values = {name: getattr(args, name) for name in names}
    values.update(overrides)
    return EngineConfig(**values)
