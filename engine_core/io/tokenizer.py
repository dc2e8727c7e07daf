"""A model's tokenizer as transformers builds it, run without transformers (and so without torch).

transformers builds a tokenizer from a model directory with many rules of its own (the class named in
tokenizer_config.json may rebuild the pipeline from vocab and merges, missing special tokens are added, the post
processor is updated, truncation and padding are switched off per call). Replaying those rules here would drift
from transformers; instead, transformers builds the tokenizer once (`build_snapshot`) and the resulting Rust
`tokenizers.Tokenizer` is saved with the few things its Python wrapper adds: the named special tokens, the chat
template and the EOS id. `Tokenizer.load` reads that snapshot with `tokenizers` alone: encode and decode are the
same Rust object's calls transformers makes, and chat templates render in transformers' jinja environment
(`chat_template.py`).

NOTE: why: importing transformers' tokenizer stack imports torch (configuration_utils -> modeling_rope_utils), ~3 s of
CPU and ~240 MB in the frontend, which needs neither (docs/decisions.md, "Tokenizer").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import tokenizers

from engine_core.io.chat_content import ChatContentEscaper
from engine_core.io.chat_template import ChatTemplate

log = structlog.get_logger(__name__)

BACKEND_FILE = "backend.json"  # the Rust tokenizer, `tokenizers.Tokenizer.to_str()`
INFO_FILE = "info.json"  # TokenizerInfo
SNAPSHOT_FORMAT = 2  # in info.json and in the snapshot's key, so a new format is a new snapshot


@dataclass(frozen=True)
class TokenizerInfo:
    """What transformers' wrapper adds to the Rust tokenizer, as saved in a snapshot."""

    special_tokens: dict[str, str]  # bos_token, eos_token, ... -> text: variables of the chat template
    chat_template: str | None
    eos_token_id: int | None
    split_special_tokens: bool  # encode special tokens' text as plain text (transformers' flag; usually False)


class Tokenizer:
    """encode / decode / chat template of one model, with transformers' results for the same calls."""

    def __init__(self, backend: tokenizers.Tokenizer, info: TokenizerInfo) -> None:
        # NOTE: transformers switches both off for every call that asks for neither, as every call here does.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = info.split_special_tokens
        self.backend_tokenizer = backend  # the name transformers uses (detokenizer.decode_function reads it)
        self.info = info
        self._template = ChatTemplate(info.chat_template) if info.chat_template else None
        self._content = ChatContentEscaper(backend)

    @classmethod
    def load(cls, snapshot_dir: str | Path) -> Tokenizer:
        d = Path(snapshot_dir)
        info = json.loads((d / INFO_FILE).read_text())
        if info.pop("format", None) != SNAPSHOT_FORMAT:
            raise ValueError(f"{d}: not a tokenizer snapshot of format {SNAPSHOT_FORMAT}")
        return cls(tokenizers.Tokenizer.from_file(str(d / BACKEND_FILE)), TokenizerInfo(**info))

    @property
    def eos_token_id(self) -> int | None:
        return self.info.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # NOTE: transformers' `clean_up_tokenization_spaces` is not applied: it is off for the models served here
        # (and transformers 5 ignores it for BPE tokenizers); vLLM's detokenizer does not apply it either.
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            raise ValueError("the model has no chat template")
        return self._template.render(messages, add_generation_prompt, self.info.special_tokens, tools)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        content_special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """transformers' `apply_chat_template(messages, add_generation_prompt=..., tokenize=True)`: the rendered
        chat, encoded without special tokens added (the template writes its own). Special-token text inside the
        messages is encoded as plain text (`chat_content.py`) unless `content_special_tokens` (trusted callers:
        then the messages' text may write control tokens, exactly as transformers encodes it). `tools`: the
        template's tool definitions (OpenAI's `{"type": "function", "function": {...}}`), escaped as the messages."""
        template = self.info.chat_template
        trusted = content_special_tokens or self.info.split_special_tokens  # split: the text is plain anyway
        # NOTE: the tools travel through the escaper as one more item, so their text cannot forge a turn either.
        items = [*messages, {"tools": list(tools)}] if tools else list(messages)
        if trusted or template is None or not self._content.needed(items):
            return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)
        masked, sentinels = self._content.mask(items, template)
        masked_tools = masked.pop()["tools"] if tools else None
        return self._content.encode(self.render_chat(masked, add_generation_prompt, masked_tools), sentinels)


def _chosen_template(template: str | dict[str, str] | None) -> str | None:
    # NOTE: transformers' `get_chat_template` without a name: a model with several named templates uses "default".
    if isinstance(template, dict):
        return template.get("default")
    return template


def hf_tokenizer(source_dir: str) -> Any:
    """transformers' own tokenizer of `source_dir` (imports transformers, and with it torch)."""
    from transformers import AutoTokenizer

    from engine_core.checkpoint.model_config import read_config_file

    # NOTE: AutoTokenizer reads only the config's model_type, tokenizer_class and name to choose the tokenizer
    # class, so the base config chooses exactly as the model's own class would (tests/test_tokenizer.py).
    return AutoTokenizer.from_pretrained(source_dir, config=read_config_file(source_dir))


def build_snapshot(source_dir: str) -> tuple[tokenizers.Tokenizer, TokenizerInfo]:
    """transformers' tokenizer of `source_dir`, as what a snapshot holds: its Rust tokenizer and the wrapper's info."""
    hf = hf_tokenizer(source_dir)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{source_dir}: transformers has no fast (Rust) tokenizer for this model")
    info = TokenizerInfo(
        special_tokens=dict(hf.special_tokens_map),
        chat_template=_chosen_template(getattr(hf, "chat_template", None)),
        eos_token_id=hf.eos_token_id,
        split_special_tokens=bool(getattr(hf, "split_special_tokens", False)),
    )
    return backend, info


def save_snapshot(backend: tokenizers.Tokenizer, info: TokenizerInfo, target: Path) -> None:
    """Writes a snapshot at `target` atomically: processes writing it at once all end with a complete one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tokenizer-"))
    try:
        (tmp / BACKEND_FILE).write_text(backend.to_str())
        (tmp / INFO_FILE).write_text(json.dumps({"format": SNAPSHOT_FORMAT, **asdict(info)}, indent=1))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# NOTE: a snapshot's key covers these files (those transformers reads to build a tokenizer), transformers' version
# and the snapshot format: a snapshot is rebuilt when any of them changes.
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


def snapshot_dir(model_dir: str, cache_dir: str) -> Path:
    source = Path(model_dir).resolve()
    parts = [f"tokenizer-snapshot-{SNAPSHOT_FORMAT}", str(source), importlib.metadata.version("transformers")]
    for name in _TOKENIZER_SOURCES:
        if (source / name).is_file():
            stat = (source / name).stat()
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokenizers" / f"{source.name}-{key}"


def load_tokenizer(model_dir: str, cache_dir: str) -> Tokenizer:
    """The tokenizer of `model_dir`, from its snapshot in the cache; transformers builds it on first use only."""
    snapshot = snapshot_dir(model_dir, cache_dir)
    if not (snapshot / INFO_FILE).is_file():
        log.info("building the tokenizer with transformers (once; cached afterwards)", model_dir=model_dir)
        backend, info = build_snapshot(model_dir)
        try:
            save_snapshot(backend, info, snapshot)
        except OSError as e:
            # NOTE: a read-only cache (the chart mounts the image's so) still serves, with the tokenizer just built:
            # at the cost of transformers' import at every start.
            log.warning("tokenizer snapshot not cached: cache not writable", cache_dir=cache_dir, error=str(e))
            return Tokenizer(backend, info)
    return Tokenizer.load(snapshot)
