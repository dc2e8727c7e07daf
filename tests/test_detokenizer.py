"""IncrementalDetokenizer on the real SmolLM2 tokenizer: multi-byte text, stop strings across tokens, streaming."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core.io.detokenizer import DetokenizerDelta, IncrementalDetokenizer, decode_function
from engine_core.sampling_params import SamplingParams

PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def stream(
    tok: Any, text: str | list[int], chunks: int = 1, stopped_by_token: bool = False, **params: Any
) -> tuple[IncrementalDetokenizer, list[DetokenizerDelta]]:
    """Feeds `text`'s tokens `chunks` at a time; returns the detokenizer and every delta (flush included)."""
    ids = tok.encode(text) if isinstance(text, str) else text
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), SamplingParams(**params))
    deltas = []
    for i in range(0, len(ids), chunks):
        last = i + chunks >= len(ids)
        deltas.append(detok.append(ids[i : i + chunks], stopped_by_token=stopped_by_token and last))
        if detok.finished:
            break
    deltas.append(DetokenizerDelta(detok.flush()))
    assert "".join(d.text_delta for d in deltas) == detok.output_text
    return detok, deltas


def test_multibyte_text_streams_without_replacement_chars(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text = "héllo 日本語 😀 world, naïve café 🎉🎉"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens really are partial characters
    detok, deltas = stream(tok, ids)
    assert detok.output_text == text == tok.decode(ids)
    assert all("\ufffd" not in d.text_delta for d in deltas)
    assert all(d.stop_string is None for d in deltas)


def test_stop_string_split_across_tokens_is_trimmed(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    text = "The answer is STOP here"
    assert "ST" in tok.convert_ids_to_tokens(tok.encode(text))[3]  # "STOP" really spans two tokens
    detok, deltas = stream(tok, text, stop=["STOP"])
    assert detok.output_text == "The answer is "
    assert detok.stop_string == "STOP"
    assert [d.stop_string for d in deltas if d.stop_string] == ["STOP"]
    # " ST" could start "STOP", so it was never shown before the match
    assert all("S" not in d.text_delta for d in deltas)


def test_include_stop_str_in_output(smollm2_tokenizer: Any) -> None:
    detok, _ = stream(smollm2_tokenizer, "The answer is STOP here", stop=["STOP"], include_stop_str_in_output=True)
    assert detok.output_text == "The answer is STOP"


def test_text_after_a_stop_inside_a_token_is_dropped(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    detok, _ = stream(tok, "The answer is here", stop=["nsw"])  # ends inside the token " answer"
    assert detok.output_text == "The a"
    detok, _ = stream(tok, "The answer is here", stop=["nsw"], include_stop_str_in_output=True)
    assert detok.output_text == "The answ"


def test_stop_string_in_the_first_token(smollm2_tokenizer: Any) -> None:
    detok, deltas = stream(smollm2_tokenizer, "Hello world", stop=["Hello"])
    assert detok.output_text == "" and deltas[0].stop_string == "Hello"
    assert deltas[0].text_delta == ""


def test_earliest_ending_stop_wins(smollm2_tokenizer: Any) -> None:
    stops = ["three four", "two", "four"]  # neither the first nor the last listed stop ends first
    detok, _ = stream(smollm2_tokenizer, "one two three four", stop=stops, chunks=10)
    assert detok.output_text == "one " and detok.stop_string == "two"
    detok, _ = stream(smollm2_tokenizer, "one two three", stop=["wo thr", "two"], chunks=10)
    assert detok.output_text == "one " and detok.stop_string == "two"


class SentencePieceLike:
    """A toy sentencepiece-style tokenizer: "▁" marks a space, and a decode drops the leading one."""

    vocab: ClassVar[list[str]] = ["▁Hello", "▁world", "!", "▁and", "▁more"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_prompt_context_keeps_the_leading_space_of_the_first_output_token() -> None:
    detok = IncrementalDetokenizer(SentencePieceLike(), [0], SamplingParams())
    deltas = [detok.append([i]).text_delta for i in (1, 2, 3, 4)]
    assert deltas == [" world", "!", " and", " more"]


def test_held_back_prefix_is_released(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    detok, deltas = stream(tok, "go STOP here", stop=["STOPPER"])
    assert detok.output_text == "go STOP here" and detok.stop_string is None
    # the text is shown as soon as it can no longer be a stop string, not only at the end
    assert deltas[-1].text_delta == ""
    detok, deltas = stream(tok, "go STO", stop=["STOPPER"])
    assert deltas[-1].text_delta == "STO"  # held until flush (the space could not start a stop string)


def test_partial_character_at_the_end_comes_out_at_flush(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    shown = "".join(detok.append([i]).text_delta for i in ids[:-1])
    assert shown == "ok" or shown == "ok "
    assert "\ufffd" not in shown
    tail = detok.flush()
    assert tail.endswith("\ufffd") and shown + tail == detok.output_text
    assert detok.append(ids[-1:]).text_delta == ""  # finished


def test_stop_token_text_is_excluded(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hello world")
    detok, _ = stream(tok, ids, stopped_by_token=True, stop_token_ids=[ids[-1]])
    assert detok.output_text == "Hello" and detok.finished
    detok, _ = stream(tok, ids, stopped_by_token=True, stop_token_ids=[ids[-1]], include_stop_str_in_output=True)
    assert detok.output_text == "Hello world"
    eos = tok.eos_token_id
    detok, _ = stream(tok, [*ids, eos], stopped_by_token=True, skip_special_tokens=False)
    assert detok.output_text == "Hello world"
    detok, _ = stream(tok, [*ids, eos], chunks=3, stopped_by_token=True, skip_special_tokens=False)
    assert detok.output_text == "Hello world"


def test_skip_special_tokens(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode("Hi<|im_start|> there")
    assert stream(tok, ids)[0].output_text == "Hi there"
    assert stream(tok, ids, skip_special_tokens=False)[0].output_text == "Hi<|im_start|> there"


def reference(text: str, stops: list[str], include: bool) -> str:
    """Cut at the stop string that ends first (longest on a tie)."""
    best = None
    for s in stops:
        pos = text.find(s)
        if pos != -1 and (best is None or (pos + len(s), -len(s)) < best):
            best = (pos + len(s), -len(s))
    if best is None:
        return text
    return text[: best[0] if include else best[0] + best[1]]


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="ab c.日本😀é\nSTOP", min_size=1, max_size=30),
    stops=st.lists(st.sampled_from(["ST", "OP", "STOP", "日本", "😀", " c", "a a", "é\n", "bb", "c."]), max_size=3),
    chunks=st.integers(min_value=1, max_value=4),
    include=st.booleans(),
)
def test_any_chunking_matches_the_reference(
    smollm2_tokenizer: Any, text: str, stops: list[str], chunks: int, include: bool
) -> None:
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    detok, deltas = stream(tok, ids, chunks=chunks, stop=stops or None, include_stop_str_in_output=include)
    assert detok.output_text == reference(tok.decode(ids), stops, include)
    assert all("\ufffd" not in d.text_delta for d in deltas)
    if not include:  # a stop string is never shown, not even in part and later retracted
        shown = "".join(d.text_delta for d in deltas)
        assert not any(s in shown for s in stops)


@pytest.mark.parametrize("chunks", [1, 2, 100])
def test_deltas_concatenate_to_the_text(smollm2_tokenizer: Any, chunks: int) -> None:
    text = "Sure! Here is a list:\n1. 日本\n2. café 😀\nEND of list"
    detok, deltas = stream(smollm2_tokenizer, text, chunks=chunks, stop=["END"])
    assert detok.output_text == "Sure! Here is a list:\n1. 日本\n2. café 😀\n"
    assert sum(1 for d in deltas if d.stop_string) == 1


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=12), skip_special=st.booleans())
def test_decode_function_is_transformers_decode(
    smollm2_tokenizer: Any, smollm2_hf_tokenizer: Any, ids: list[int], skip_special: bool
) -> None:
    """The fast path (the Rust backend's decode) returns what transformers' `decode` does, special tokens included."""
    tok = smollm2_tokenizer
    assert hasattr(tok, "backend_tokenizer")  # the path under test is the one taken for the real model
    expected = smollm2_hf_tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)
    assert decode_function(tok, skip_special)(ids) == expected
