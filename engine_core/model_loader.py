"""Reads a resolved model directory's config and weights (see model_files.py for finding the directory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(model_dir: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_dir)


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from every safetensors file of the directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        index = Path(model_dir) / "pytorch_model.bin"
        if index.is_file():
            yield from torch.load(index, map_location="cpu", weights_only=True).items()
            return
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def architecture(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else f"{config.model_type}ForCausalLM"
