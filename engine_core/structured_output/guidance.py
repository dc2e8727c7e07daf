"""The llguidance backend: its matchers compute masks lazily from the token trie (no per-grammar precompute), in
Rust, without the GIL, as plain int32 words; no torch anywhere.

The tokenizer (the model directory's `tokenizer.json`) is built once, by the first constrained request's compile
(~0.5 s for a 50k vocabulary, which that request waits for).
NOTE: on first use, not at construction: llguidance's tokenizer holds ~35 MB (SmolLM2's vocabulary; ~60 MB while
it builds) in every engine process, which most never use; vLLM too builds its grammar backend on the first
structured-output request (docs/benchmarks.md, "Peak RSS of the offline benchmark").
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from engine_core.structured_output.backend import (
    GRAMMAR_CACHE_SIZE,
    GrammarCompile,
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputError,
)
from engine_core.structured_output.grammar import field_name, parser_limits, to_grammar
from engine_core.structured_output.params import StructuredOutputsParams


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
        """`on_compile` is told about every grammar compiled (on the compile thread, or the step's on a fallback)
        and every matcher copied from the cache (the step's thread): metrics and spans."""
        self.vocab_size = vocab_size
        self._tokenizer_json, self._eos_token_id = tokenizer_json, eos_token_id
        self._tokenizer: llguidance.LLTokenizer | None = None  # built by `_llg_tokenizer` on first use
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()  # key -> template, copied per sequence
        self._compiling: dict[tuple, Future[None]] = {}  # key -> its compile on the compile thread
        self._lock = threading.Lock()  # the cache and `_compiling`: the step's and the compile thread share them
        self._compiler: ThreadPoolExecutor | None = None  # made on first use
        self._executor = llguidance.LLExecutor()
        self.on_compile = on_compile

    def prepare(self, params: StructuredOutputsParams) -> Future[None]:
        key = params.key
        with self._lock:
            if key in self._cache:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            future = self._compiling.get(key)
            if future is None:
                if self._compiler is None:
                    # NOTE: one thread: compiles queue behind each other, never beside the step's Python for more
                    # than the GIL's share; llguidance's own work bounds each (grammar.LIMITS).
                    self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                future = self._compiler.submit(self._compile, params)
                self._compiling[key] = future
            return future

    def matcher(self, params: StructuredOutputsParams) -> GuidanceMatcher:
        t0 = time.perf_counter()
        key = params.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
            future = self._compiling.get(key)
        if template is not None:
            matcher = GuidanceMatcher(template.deep_copy())
            if self.on_compile is not None:
                self.on_compile(GrammarCompile(params.kind.value, time.perf_counter() - t0, True, t0))
            return matcher
        if future is not None:
            future.result()  # raises the compile's StructuredOutputError
            with self._lock:
                template = self._cache.get(key)
        if template is None:  # never prepared (the scheduler's gate was skipped), or evicted since
            template = self._compile(params)
        return GuidanceMatcher(template.deep_copy())

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """Compiles the constraint into the cache (its template matcher); StructuredOutputError when it does not."""
        t0 = time.perf_counter()
        key = params.key
        try:
            try:
                tokenizer = self._llg_tokenizer()
            except Exception as e:
                raise StructuredOutputError(f"structured output is unavailable: the tokenizer did not load: {e}") from e
            try:
                grammar = to_grammar(params)
            except ValueError as e:
                raise StructuredOutputError(str(e)) from None
            template = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits())
            if template.is_error():
                raise StructuredOutputError(f"{field_name(params)} is invalid: {template.get_error()}")
            with self._lock:
                self._cache[key] = template
                if len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        if self.on_compile is not None:
            self.on_compile(GrammarCompile(params.kind.value, time.perf_counter() - t0, False, t0))
        return template

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer, built on the first call (a failed build raises, and the next call tries again)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                text = self._tokenizer_json.read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos_token_id)
            return self._tokenizer

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
