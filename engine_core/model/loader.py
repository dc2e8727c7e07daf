"""Reads a resolved model directory's config and weights (see model_files.py for finding the directory)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine_core.checkpoint.model_config import is_plain_llama, read_config_json, read_llama_config
from engine_core.checkpoint.model_dir import gguf_file, weight_files
from engine_core.model.layers.block_codes import BlockCodes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


if TYPE_CHECKING:
    from engine_core.checkpoint.model_config import ModelConfig


def load_config(model_dir: str) -> ModelConfig:
    """The model's config. A complete Llama config with plain RoPE is read by the engine (`read_llama_config`: no
    import of transformers, 2.3 s for its model config classes and ~17-20 MB for even its base class); anything else
    goes through `AutoConfig`, whose model classes fill in defaults (Mistral's sliding window, missing KV heads) and
    standardise RoPE scaling."""
    # NOTE: presence is checked in the file, not on a config object: transformers' base class has defaults of its
    # own (tie_word_embeddings=True) that differ from Llama's.
    raw = read_config_json(model_dir)
    if is_plain_llama(raw):
        return read_llama_config(raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def prefetch_weights(model_dir: str) -> None:
    """Asks the kernel to read the weight files into the page cache in the background, so that the disk read overlaps
    the imports and model construction that come before `iter_weights`.

    NOTE: measured on this VM, whose page cache is reclaimed within minutes: a cold read of SmolLM2's 540 MB of
    float32 weights made `model loaded` take 3.5 s instead of 1.1 s (its GGUF file, read since, is 98 MB). The hint
    (POSIX_FADV_WILLNEED) costs nothing when the files are cached and is skipped where the platform lacks it.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    files = weight_files(model_dir)

    def read_ahead() -> None:
        for file in files:
            try:
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)
            except OSError:
                return  # a hint only: the load that follows reports real errors

    # NOTE: a thread, because the kernel may block the caller while it queues a large read-ahead.
    threading.Thread(target=read_ahead, name="prefetch-weights", daemon=True).start()


def iter_weights(
    model_dir: str, config: ModelConfig, with_codes: bool = False, legacy_codes: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockCodes]]:
    """Yields (HF name, tensor) from the directory's GGUF file or from every safetensors file of it; with
    `with_codes`, a GGUF K-quant matrix as its codes, with `legacy_codes` too a Q8_0 ... Q5_1 one
    (model/gguf_weights.py)."""
    gguf = gguf_file(model_dir)
    if gguf is not None:
        # NOTE: imported here: gguf-py is needed for GGUF models only (the GPU check's machine has none).
        from engine_core.model.gguf_weights import iter_gguf_weights

        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        yield from iter_gguf_weights(gguf, heads, kv_heads, with_codes, legacy_codes)
        return
    files = weight_files(model_dir)
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


def architecture(config: ModelConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else f"{config.model_type}ForCausalLM"
