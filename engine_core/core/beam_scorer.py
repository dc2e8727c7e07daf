"""One beam group's scoring, step by step, with transformers' semantics (generation/utils.py `_beam_search`).

Pure Python over each running beam's top candidates (token, logprob), so it runs in the scheduler, which loads no
torch. Each step:
  1. every candidate's cumulative logprob = its beam's + its logprob (float32, as transformers adds them);
  2. the best K = max(2, 1 + stop tokens) x beam_width candidates over all beams, best first;
  3. running next: the best beam_width of those that do not stop (a stop token, a `stop` string its text completes
     (core/beam_stop.py; transformers' beam search has no per-beam stop strings), or the length limit);
  4. finished: the stopping ones among the best beam_width, scored cum_logprob / generated_len ** length_penalty
     (generated_len counts the stop token), kept if they rank among the beam_width best hypotheses;
  5. the search ends when every candidate stops (length limit), when early_stopping is True and beam_width
     hypotheses are finished, or when no running beam can beat the worst of beam_width finished hypotheses: its
     score at the current length (at the longest length for early_stopping="never" with length_penalty > 0).
Ties are broken by beam order, then token id (transformers leaves them to torch.topk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_core.core.beam_stop import BeamStopStrings

# transformers' stand-in for "minus infinity" in its score tensors.
_NEG = np.float32(-1.0e9)


@dataclass
class Candidate:
    beam: int  # index of the parent among the running beams
    token: int
    cum_logprob: np.float32


@dataclass
class Hypothesis:
    output_token_ids: list[int]  # generated tokens, the stop token included
    cum_logprob: float
    score: float
    stopped: bool  # ended on a stop token or a stop string (else on the length limit)
    stop_string: str | None = None  # the `stop` string its text completed


@dataclass
class BeamStep:
    survivors: list[Candidate]  # the next running beams in order; empty when `done`
    done: bool
    num_finished: int  # hypotheses added this step


class BeamScorer:
    def __init__(
        self,
        beam_width: int,
        length_penalty: float,
        early_stopping: bool | str,
        stop_token_ids: set[int],
        max_new_tokens: int,
        stop_strings: BeamStopStrings | None = None,
    ) -> None:
        self.beam_width = beam_width
        self.stop_strings = stop_strings
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.stop_token_ids = stop_token_ids
        self.max_new_tokens = max_new_tokens
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * beam_width
        self.cum: list[np.float32] = [np.float32(0.0)]  # per running beam, in order
        self.hypotheses: list[Hypothesis] = []  # best first, at most beam_width
        self._improvable = True  # transformers' is_early_stop_heuristic_unsatisfied (once False, stays False)

    def _normalise(self, value: np.float32, length: int) -> np.float32:
        return np.float32(value / np.float32(float(length) ** self.length_penalty))

    @property
    def _full(self) -> bool:
        return len(self.hypotheses) >= self.beam_width

    def step(self, rows: list[list[tuple[int, float]]], outputs: list[list[int]], at_limit: bool) -> BeamStep:
        """`rows[b]`: running beam b's top candidates (token, logprob); `outputs[b]`: its generated tokens so far;
        `at_limit`: the token chosen now reaches the length limit (every candidate stops)."""
        assert len(rows) == len(self.cum) == len(outputs), "one row per running beam"
        cands = [
            Candidate(b, int(tok), np.float32(self.cum[b] + np.float32(lp)))
            for b, row in enumerate(rows)
            for tok, lp in row
        ]
        cands.sort(key=lambda c: (-float(c.cum_logprob), c.beam, c.token))
        cands = cands[: self.num_candidates]
        strings = self._stop_strings(cands, outputs)
        stops = [
            at_limit or c.token in self.stop_token_ids or s is not None for c, s in zip(cands, strings, strict=True)
        ]
        gen_len = len(outputs[0]) + 1

        added = 0
        if self._improvable and not (self._full and self.early_stopping is True):
            for c, stop, string in zip(cands[: self.beam_width], stops, strings, strict=False):
                if stop:
                    score = self._normalise(c.cum_logprob, gen_len)
                    stopped = c.token in self.stop_token_ids or string is not None
                    tokens = [*outputs[c.beam], c.token]
                    self.hypotheses.append(Hypothesis(tokens, float(c.cum_logprob), float(score), stopped, string))
                    added += 1
            # NOTE: a stable sort keeps earlier hypotheses ahead of equal-scored new ones.
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[self.beam_width :]

        survivors = [c for c, stop in zip(cands, stops, strict=True) if not stop][: self.beam_width]
        if all(stops) or not survivors:
            return BeamStep([], True, added)
        self.cum = [c.cum_logprob for c in survivors]
        if self._improvable and self._full:
            longest = self.early_stopping == "never" and self.length_penalty > 0
            best_len = self.max_new_tokens if longest else gen_len
            best_possible = self._normalise(survivors[0].cum_logprob, best_len)
            worst = min(np.float32(h.score) for h in self.hypotheses)
            self._improvable = bool(best_possible > worst)
        done = not self._improvable or (self._full and self.early_stopping is True)
        return BeamStep([] if done else survivors, done, added)

    def _stop_strings(self, cands: list[Candidate], outputs: list[list[int]]) -> list[str | None]:
        """Per candidate, the stop string its text completes (a stop token takes precedence, as in `check_stop`)."""
        matcher = self.stop_strings
        if matcher is None:
            return [None] * len(cands)
        return [None if c.token in self.stop_token_ids else matcher.match(outputs[c.beam], c.token) for c in cands]
