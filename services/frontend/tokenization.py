"""Prompts -> token ids: plain text, chat messages (the model's chat template) or ids checked against the vocab."""

from __future__ import annotations

from engine_core.core.prompt_checks import check_token_ids
from engine_core.io.bad_words import bad_words_token_ids
from engine_core.io.tokenizer import Tokenizer
from services.frontend.request import ChatMessage, PromptInput, RequestError

_ROLES = ("system", "user", "assistant", "tool", "developer")


class PromptTokenizer:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, chat_content_special_tokens: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_content_special_tokens = chat_content_special_tokens  # trusted callers may write control tokens

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.has_chat_template

    def encode(self, prompt: PromptInput, check_length: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text if known, token ids); RequestError(INVALID_ARGUMENT) naming the field when unusable."""
        given = [x is not None for x in (prompt.text, prompt.token_ids, prompt.messages)]
        if sum(given) != 1:
            raise RequestError.invalid(f"{prompt.field} is required (exactly one of text, token ids or messages)")
        cut = prompt.truncate_prompt_tokens
        keep = self._kept_tokens(cut) if cut is not None else None  # NOTE: checked before any tokenizing
        if prompt.text is not None:
            text: str | None = prompt.text
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        elif prompt.token_ids is not None:
            text, ids = None, list(prompt.token_ids)
            try:
                check_token_ids(ids, self.vocab_size, prompt.field)
            except ValueError as e:
                raise RequestError.invalid(str(e)) from e
        else:
            text, ids = None, self.apply_chat_template(prompt)
        if keep is not None and len(ids) > keep:
            text, ids = None, ids[len(ids) - keep :]  # NOTE: the kept tail is no longer the text's encoding
        if not ids:
            raise RequestError.invalid(f"{prompt.field} must not be empty (it encodes to zero tokens)")
        if check_length and len(ids) >= self.max_model_len:
            raise RequestError.invalid(
                f"{prompt.field} is {len(ids)} tokens long but max_model_len is {self.max_model_len}: "
                "the prompt must be shorter than max_model_len to leave room for output"
            )
        return text, ids

    def _kept_tokens(self, k: int) -> int:
        if k == -1:
            return self.max_model_len
        if not 1 <= k <= self.max_model_len:
            raise RequestError.invalid(
                f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, {self.max_model_len}], got {k}",
                "truncate_prompt_tokens",
            )
        return k

    def apply_chat_template(self, prompt: PromptInput) -> list[int]:
        messages = prompt.messages or []
        if not messages:
            raise RequestError.invalid(f"{prompt.field} must contain at least one message")
        for i, m in enumerate(messages):
            if m.role not in _ROLES:
                raise RequestError.invalid(f"{prompt.field}.{i}.role must be one of {_ROLES}, got {m.role!r}")
        if not self.has_chat_template:
            raise RequestError.invalid(f"{prompt.field}: the model has no chat template; send text or token ids")
        conversation = [_template_message(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, prompt.add_generation_prompt, self.chat_content_special_tokens, prompt.tools
            )
        except Exception as e:  # NOTE: jinja templates raise anything (e.g. "roles must alternate")
            raise RequestError.invalid(f"{prompt.field}: the chat template rejected the messages: {e}") from e

    def bad_words(self, words: list[str]) -> list[list[int]]:
        return bad_words_token_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False), words)

    def tokens(self, ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(ids)


def _template_message(m: ChatMessage) -> dict[str, object]:
    """A message as chat templates read it (transformers' and OpenAI's keys; None values are dropped there)."""
    calls = None
    if m.tool_calls is not None:
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    return {"role": m.role, "content": m.content, "tool_calls": calls, "tool_call_id": m.tool_call_id, "name": m.name}
