"""A model directory's config.json: a complete Llama config read into the engine's own class, anything else as written
in transformers' base config class. No tokenizer, no torch.

NOTE: its own module so that the worker's import path (model_runner -> model_loader) reads config.json without
importing `model_files`, whose `AutoTokenizer` import pulls in transformers' tokenizer stack. On the GPU image
(torch 2.11+cu130, transformers 5.17, triton installed) that chain reached `transformers.generation.utils` ->
`masking_utils` -> `torch._dynamo`, whose utils import triton: Triton in the CPU engine, which
tests/kernels/test_triton_mode.py::test_cpu_kernels_and_the_cpu_engine_import_no_triton forbids (seen on the GPU image;
the CPU machine's transformers 5.23 and CPU torch do not take that path, so only the GPU run shows it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    from transformers import PretrainedConfig

    # What the engine reads a model's shape from: its own class for a plain Llama, transformers' config otherwise.
    ModelConfig: TypeAlias = "LlamaConfigFile | PretrainedConfig"

# A Llama config.json that sets these needs none of LlamaConfig's defaults for what the engine reads.
LLAMA_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)
DEFAULT_ROPE_THETA = 10000.0  # LlamaConfig's, for a config.json that names none


@dataclass(frozen=True)
class LlamaConfigFile:
    """A complete Llama config.json with plain RoPE, as the engine reads it (the attributes transformers' config
    classes give it the same names, so the model code reads either).

    NOTE: why not transformers' base class (`read_config_file`): importing `transformers.configuration_utils` alone
    costs ~17-20 MB of RSS (its config classes, `ROPE_INIT_FUNCTIONS`), ~1 % of the offline benchmark's peak,
    for a file whose every field the engine reads is listed here (docs/benchmarks.md, "Peak RSS of the offline
    benchmark"). tests/test_model_files.py checks each against `AutoConfig`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "llama"
    architectures: list[str] | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rope_theta: float = DEFAULT_ROPE_THETA
    sliding_window: int | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def rope_parameters(self) -> dict[str, object]:
        """transformers' standard form of a plain RoPE (what `LlamaConfig.rope_parameters` holds)."""
        return {"rope_type": "default", "rope_theta": self.rope_theta}


def is_plain_llama(raw: dict[str, object]) -> bool:
    """Whether `LlamaConfigFile` reads this config.json as AutoConfig would: a Llama with every required key and
    plain RoPE (no scaling)."""
    rope = raw.get("rope_parameters") or {}
    plain_rope = (
        isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and not raw.get("rope_scaling")
    )
    return raw.get("model_type") == "llama" and plain_rope and all(k in raw for k in LLAMA_REQUIRED_KEYS)


def _number(raw: dict[str, object], key: str, kind: type[int] | type[float]) -> int | float:
    value = raw[key]
    # NOTE: bool is an int in Python; a config.json that says `true` for a size is wrong, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"config.json: {key} = {value!r} is not {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _optional_int(raw: dict[str, object], key: str) -> int | None:
    return None if raw.get(key) is None else int(_number(raw, key, int))


def read_llama_config(raw: dict[str, object]) -> LlamaConfigFile:
    """`raw` (a config.json that `is_plain_llama`) in the engine's own class; a wrong type names its key."""
    rope = raw.get("rope_parameters") or {}
    assert isinstance(rope, dict)
    theta = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else raw
    archs = raw.get("architectures")
    eos = raw.get("eos_token_id")
    return LlamaConfigFile(
        vocab_size=int(_number(raw, "vocab_size", int)),
        hidden_size=int(_number(raw, "hidden_size", int)),
        intermediate_size=int(_number(raw, "intermediate_size", int)),
        num_hidden_layers=int(_number(raw, "num_hidden_layers", int)),
        num_attention_heads=int(_number(raw, "num_attention_heads", int)),
        num_key_value_heads=int(_number(raw, "num_key_value_heads", int)),
        rms_norm_eps=float(_number(raw, "rms_norm_eps", float)),
        max_position_embeddings=int(_number(raw, "max_position_embeddings", int)),
        tie_word_embeddings=bool(raw["tie_word_embeddings"]),
        architectures=[str(a) for a in archs] if isinstance(archs, list) else None,
        head_dim=_optional_int(raw, "head_dim"),
        hidden_act=str(raw.get("hidden_act", "silu")),
        rope_theta=float(_number(theta, "rope_theta", float)) if "rope_theta" in theta else DEFAULT_ROPE_THETA,
        sliding_window=_optional_int(raw, "sliding_window"),
        eos_token_id=eos if isinstance(eos, (int, list)) and not isinstance(eos, bool) else None,
    )


def read_config_json(model_dir: str) -> dict[str, object]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def read_config_file(model_dir: str, raw: dict[str, object] | None = None) -> PretrainedConfig:
    """config.json as written, in transformers' base config class (no model-specific defaults filled in): what
    transformers' tokenizer classes take.

    NOTE: `AutoConfig` imports the model's own config class, and in transformers 5 that import pulls in
    `torch._dynamo` and the hub-kernel integrations: 2.3 s of CPU in the worker and 3.3 s in the frontend on this
    machine, both on `pagoda serve`'s start-up path. The base class needs none of that. `raw`: the file, if read.
    NOTE: transformers imported here: the engine's own path reads a Llama config without it (`read_llama_config`).
    """
    from transformers import PretrainedConfig

    config = PretrainedConfig.from_dict(read_config_json(model_dir) if raw is None else raw)
    config._name_or_path = model_dir  # what AutoConfig records; AutoTokenizer matches it against known hub ids
    return config
