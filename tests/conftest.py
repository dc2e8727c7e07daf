"""Shared fixtures: the real SmolLM2 weights (converted once, cached) and its tokenizer."""

from __future__ import annotations

import os

# NOTE: triton's own library functions are decorated when triton is first imported (transformers may import it),
# so the interpreter switch must be set before anything else on a machine without a GPU.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from engine_core.model_files import load_tokenizer, resolve_model_dir

CACHE_DIR = os.path.expanduser(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (converted from the packaged GGUF on first use)."""
    return resolve_model_dir(None, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    return load_tokenizer(smollm2_dir)
