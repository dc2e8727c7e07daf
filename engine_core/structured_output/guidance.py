"""The llguidance backend: its matchers compute masks lazily from the token trie (no per-grammar precompute), in
Rust, without the GIL, as plain int32 words; no torch anywhere.

The tokenizer (the model directory's `tokenizer.json`) is loaded once, in a background thread from construction,
since it takes ~0.5 s for a 50k vocabulary; the first constrained request waits for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from engine_core.structured_output.backend import (
    GrammarCompile,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputError,
)
from engine_core.structured_output.grammar import field_name, parser_limits, to_grammar
from engine_core.structured_output.params import StructuredOutputsParams

# Compiled grammars kept (a template matcher each, deep-copied per sequence).
GRAMMAR_CACHE_SIZE = 256


class GuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher

    def consume(self, token_id: int) -> bool:
        return bool(self.ll.consume_token(token_id))

    def error(self) -> str | None:
        return self.ll.get_error() or None if self.ll.is_error() else None


class GuidanceBackend(StructuredOutputBackend):
    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_id: int | None,
        on_compile: Callable[[GrammarCompile], None] | None = None,
    ) -> None:
        """`on_compile` is told about every matcher made (metrics, the step's span); it runs on the step's thread."""
        self.vocab_size = vocab_size
        self._tokenizer: Future[llguidance.LLTokenizer] = Future()
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self.on_compile = on_compile

        def load() -> None:
            try:
                text = tokenizer_json.read_text(encoding="utf-8")
                self._tokenizer.set_result(llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos_token_id))
            except Exception as e:  # surfaced on the first constrained request, which fails alone
                self._tokenizer.set_exception(e)

        threading.Thread(target=load, name="llguidance-tokenizer", daemon=True).start()

    def matcher(self, params: StructuredOutputsParams) -> GuidanceMatcher:
        t0 = time.perf_counter()
        key = params.key
        template = self._cache.get(key)
        hit = template is not None
        if template is None:
            try:
                tokenizer = self._tokenizer.result()
            except Exception as e:
                raise StructuredOutputError(f"structured output is unavailable: the tokenizer did not load: {e}") from e
            try:
                grammar = to_grammar(params)
            except ValueError as e:
                raise StructuredOutputError(str(e)) from None
            template = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits())
            if template.is_error():
                raise StructuredOutputError(f"{field_name(params)} is invalid: {template.get_error()}")
            self._cache[key] = template
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        matcher = GuidanceMatcher(template.deep_copy())
        if self.on_compile is not None:
            self.on_compile(GrammarCompile(params.kind.value, time.perf_counter() - t0, hit, t0))
        return matcher

    def fill_masks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        pairs = [(m.ll, row) for m, row in matchers if isinstance(m, GuidanceMatcher)]
        if len(pairs) == 1:
            llg_numpy.fill_next_token_bitmask(pairs[0][0], bitmask, pairs[0][1])
        elif pairs:
            llg_numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)


def backend_for_model(model_dir: str | Path, vocab_size: int, eos_token_id: object) -> GuidanceBackend | None:
    """The backend of a model directory; None when it has no `tokenizer.json` (a constrained request then fails
    alone, saying so). `eos_token_id` as config.json has it: an id, a list of ids (the first ends a grammar) or None."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    if isinstance(eos_token_id, list):
        eos_token_id = eos_token_id[0] if eos_token_id else None
    return GuidanceBackend(path, vocab_size, eos_token_id if isinstance(eos_token_id, int) else None)
