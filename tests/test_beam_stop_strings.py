"""Stop strings end beams during the search (core/beam_stop.py): a beam whose text completes a `stop` string becomes
a finished hypothesis there, its text cut before the string (kept with include_stop_str_in_output); no returned
hypothesis runs past a match. A tiny random Llama with SmolLM2's real tokenizer, so the text is real detokenization.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_core import LLM, BeamSearchParams

PROMPT = "Answer:"


@pytest.fixture(scope="module")
def llm(tiny_vocab_dir: Path) -> LLM:
    return LLM(str(tiny_vocab_dir), kv_cache_memory=0.05, max_model_len=256)


def outputs(llm: LLM, params: BeamSearchParams) -> list[tuple[list[int], str, str | None, int | str | None]]:
    """(generated tokens, generated text, finish_reason, stop_reason) of each returned hypothesis."""
    (out,) = llm.beam_search([PROMPT], params, use_tqdm=False)
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    prompt_text = llm.tokenizer.decode(llm.tokenizer.encode(PROMPT), skip_special_tokens=True)
    return [
        (s.tokens[n_prompt:], (s.text or "")[len(prompt_text) :], s.finish_reason, s.stop_reason) for s in out.sequences
    ]


def a_stop_string(llm: LLM, tokens: list[int]) -> str:
    """Two characters the text of `tokens` first completes at its 4th token or later (none of them spaces)."""
    decode = llm.core.beam_decode
    assert decode is not None
    for k in range(4, len(tokens)):
        s = decode(tokens[:k])[-2:]
        if len(s) == 2 and not s.isspace() and s not in decode(tokens[: k - 1]):
            return s
    raise AssertionError("no usable stop string in the best beam")


def test_a_beam_that_completes_a_stop_string_ends_there(llm: LLM) -> None:
    width, max_tokens = 4, 24
    free = outputs(llm, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    stop = a_stop_string(llm, free[0][0])
    decode = llm.core.beam_decode
    assert decode is not None
    # Without stop strings in the search, the best hypothesis runs on past the string (what vLLM returns).
    assert stop in decode(free[0][0][:-1])

    for keep in (False, True):
        params = BeamSearchParams(
            beam_width=width, max_tokens=max_tokens, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep
        )
        got = outputs(llm, params)
        assert len(got) == width
        for tokens, text, finish, stop_reason in got:
            # no hypothesis continues past a match: only its last token may complete the string
            assert stop not in decode(tokens[:-1])
            if finish == "stop":
                assert stop_reason == stop and stop in decode(tokens)
                full = decode(tokens)
                cut = full[: full.find(stop) + (len(stop) if keep else 0)]
                assert text == cut
            else:
                assert finish == "length" and len(tokens) == max_tokens and stop not in text
        assert any(finish == "stop" for *_, finish, _ in got)


def test_no_stop_string_no_change(llm: LLM) -> None:
    """A stop string the beams never write leaves the search exactly as without one."""
    params = {"beam_width": 4, "max_tokens": 12, "ignore_eos": True}
    plain = outputs(llm, BeamSearchParams(**params))
    never = outputs(llm, BeamSearchParams(**params, stop=["\u2603\u2603never"]))
    assert [t for t, *_ in never] == [t for t, *_ in plain]
