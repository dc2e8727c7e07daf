"""Shared fixtures: the real SmolLM2 weights (converted once, cached) and its tokenizer."""

from __future__ import annotations

from kernels.triton_mode import configure_triton_interpret

# NOTE: first, before anything imports triton (the same decision the kernels package makes).
configure_triton_interpret()

import pytest
import torch

from engine_core.config import default_cache_dir
from engine_core.model_files import load_tokenizer, resolve_model_dir

CACHE_DIR = default_cache_dir()

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (converted from the packaged GGUF on first use)."""
    return resolve_model_dir(None, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    return load_tokenizer(smollm2_dir)
