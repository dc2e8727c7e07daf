"""Shared fixtures: the real SmolLM2 weights (converted once, cached) and its tokenizer."""

from __future__ import annotations

import os

import pytest
import torch

from engine_core.model_loader import load_tokenizer, resolve_model_dir

CACHE_DIR = os.path.expanduser(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (converted from the packaged GGUF on first use)."""
    return resolve_model_dir(None, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):  # noqa: ANN201 - a transformers tokenizer
    return load_tokenizer(smollm2_dir)
