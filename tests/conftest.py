"""Shared fixtures: the real SmolLM2 weights (converted once, cached) and its tokenizer."""

from __future__ import annotations

import os

from kernels.triton_mode import configure_triton_mode

# NOTE: triton's own library functions are decorated when triton is first imported (transformers may import it),
# so the one interpreter-or-compiled decision is made before anything else imports it.
configure_triton_mode()

import pytest  # noqa: E402
import torch  # noqa: E402

CACHE_DIR = os.path.expanduser(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda"))

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (converted from the packaged GGUF on first use)."""
    # NOTE: imported here, not at the top, so the kernel tests also collect where only torch/triton/pytest exist.
    from engine_core.model_loader import resolve_model_dir

    return resolve_model_dir(None, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    from engine_core.model_loader import load_tokenizer

    return load_tokenizer(smollm2_dir)
