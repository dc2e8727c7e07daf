"""Stop strings during a beam search: a candidate whose text completes a `stop` string is a finished hypothesis,
as a stop token makes it (vLLM's `LLM.beam_search` ignores them: its issues #9253, #22696).

NOTE: a beam is live only while none of its text matched, so a new match ends in the candidate's own token; the
text checked is the decode of the beam's last tokens plus the candidate (a window of the longest stop string's
length plus `WINDOW_SLACK` tokens: a token is at least one character except for byte pieces of one character).
"""

from __future__ import annotations

from collections.abc import Callable

WINDOW_SLACK = 8


class BeamStopStrings:
    def __init__(self, stop: list[str], decode: Callable[[list[int]], str]) -> None:
        self.stop = [s for s in stop if s]
        self.decode = decode  # token ids -> text, without special tokens (the tokenizer's)
        self.window = max((len(s) for s in self.stop), default=0) + WINDOW_SLACK

    def match(self, output_token_ids: list[int], token: int) -> str | None:
        """The stop string the beam's text completes when `token` follows `output_token_ids` (None: none)."""
        text = self.decode([*output_token_ids[-self.window :], token])
        for s in self.stop:
            if s in text:
                return s
        return None
