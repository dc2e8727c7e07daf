"""What a model directory holds besides config.json and the tokenizer: safetensors, or (the cached directory of a
GGUF model, model_files.py) a link to the GGUF file whose weights are decoded at load (gguf_weights.py).

NOTE: its own module, importing nothing, so that the worker's import path (model_loader) can tell the two apart
without importing `model_files` and its tokenizer stack (see model_config.py).
"""

from __future__ import annotations

import os
from pathlib import Path

# transformers reads the link too: `from_pretrained(model_dir, gguf_file=GGUF_LINK)`.
GGUF_LINK = "model.gguf"


def gguf_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a model directory reads its weights from, or None for a safetensors directory.

    NOTE: a dangling link still counts, so that a moved GGUF file fails the load with its own name, not as
    "no safetensors".
    """
    link = Path(model_dir) / GGUF_LINK
    return link if os.path.lexists(link) else None


def weight_files(model_dir: str | Path) -> list[Path]:
    """The files that hold a directory's weights: its GGUF file, else its safetensors (sorted; may be none)."""
    gguf = gguf_file(model_dir)
    return [gguf] if gguf else sorted(Path(model_dir).glob("*.safetensors"))


def transformers_kwargs(model_dir: str | Path) -> dict[str, str]:
    """What `from_pretrained(model_dir, ...)` needs to load the weights with transformers (the tests' reference)."""
    return {"gguf_file": GGUF_LINK} if gguf_file(model_dir) else {}
