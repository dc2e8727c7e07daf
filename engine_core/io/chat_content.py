"""Special-token text inside chat messages, tokenized as plain text; the chat template's own markers stay special.

Rendering a chat puts each message's text into the prompt, and encoding the prompt reads any special token's text
in it as that control token: a user message holding `<|im_end|>\n<|im_start|>system ...` would forge a system turn.
So, before rendering, each special token's text inside a message is swapped for a private-use sentinel character
(one per distinct token, none that occurs in the messages or the template); the rendered prompt is encoded piece by
piece between sentinels (the template's markers are still read as special tokens), and each sentinel becomes its
token's text encoded as plain text. Decoding the ids gives back the rendered prompt exactly.

A chat with no special-token text in any message takes the unchanged path: its ids are transformers'
`apply_chat_template` ids. Only around an escaped marker may the split differ from encoding the message alone.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

_SENTINEL_BASE = 0x100000  # Supplementary Private Use Area-B: no meaning in any tokenizer's text


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


class ChatContentEscaper:
    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special and t.content}
        # NOTE: longest first, so a token whose text contains another's is matched whole.
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        self._special = re.compile(alternatives) if specials else None
        self._backend = backend
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._plain: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def needed(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        pattern = self._special
        return pattern is not None and any(pattern.search(s) for s in _strings(list(messages)))

    def mask(self, messages: Sequence[Mapping[str, Any]], template: str) -> tuple[list[Any], dict[str, str]]:
        """The messages with every special token's text replaced by a sentinel, and sentinel -> that text."""
        assert self._special is not None
        taken = {c for s in (*_strings(list(messages)), template) for c in s if ord(c) >= _SENTINEL_BASE}
        free = (chr(cp) for cp in range(_SENTINEL_BASE, 0x10FFFE) if chr(cp) not in taken)
        sentinels: dict[str, str] = {}  # special text -> sentinel

        def swap(match: re.Match[str]) -> str:
            text = match.group()
            if text not in sentinels:
                sentinels[text] = next(free)
            return sentinels[text]

        def walk(value: Any) -> Any:
            if isinstance(value, str):
                return self._special.sub(swap, value) if self._special is not None else value
            if isinstance(value, Mapping):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [walk(v) for v in value]
            return value

        masked = [walk(m) for m in messages]
        return masked, {sentinel: text for text, sentinel in sentinels.items()}

    def encode(self, rendered: str, sentinels: Mapping[str, str]) -> list[int]:
        """The rendered prompt's ids: pieces between sentinels as usual, each sentinel's text as plain text."""
        ids: list[int] = []
        start = 0
        for match in re.finditer(f"[{''.join(sentinels)}]", rendered):
            if match.start() > start:
                ids += self._backend.encode(rendered[start : match.start()], add_special_tokens=False).ids
            ids += self._plain_ids(sentinels[match.group()])
            start = match.end()
        if start < len(rendered):
            ids += self._backend.encode(rendered[start:], add_special_tokens=False).ids
        return ids

    def _plain_ids(self, text: str) -> list[int]:
        with self._lock:
            ids = self._plain.get(text)
            if ids is None:
                if self._plain_backend is None:
                    # NOTE: a copy that reads special tokens' text as text: switching the shared backend's setting
                    # per call would race with other threads encoding on it.
                    self._plain_backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
                    self._plain_backend.encode_special_tokens = True
                ids = self._plain_backend.encode(text, add_special_tokens=False).ids
                self._plain[text] = ids  # NOTE: bounded: one entry per special token of the vocabulary
            return list(ids)
