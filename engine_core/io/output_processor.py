"""Turns the core's per-sequence token outputs into text: detokenization, stop strings, logprobs, RequestOutput.

It runs where the tokenizer lives: in the offline `LLM` and in the gRPC frontend. A stop string is found here,
so the caller must then end that choice in the core (`ProcessedStep.stops`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine_core.core.request import FinishReason
from engine_core.core.seq_output import SeqOutput, TokenLogprobs
from engine_core.io.detokenizer import IncrementalDetokenizer
from engine_core.io.request_output import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from engine_core.io.tokenizer import Tokenizer
from engine_core.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    """What one step added to one choice (for streaming)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


@dataclass
class StopMatch:
    request_id: str
    index: int
    stop: str


@dataclass
class RequestUpdate:
    output: RequestOutput  # cumulative
    deltas: list[ChoiceDelta]


@dataclass
class ProcessedStep:
    updates: list[RequestUpdate] = field(default_factory=list)
    stops: list[StopMatch] = field(default_factory=list)


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    output: CompletionOutput
    finish: FinishReason | None = None


class _RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        arrival: float,
        keep_logprobs: bool,
    ) -> None:
        self.params = params
        self.choices = [
            _Choice(IncrementalDetokenizer(tokenizer, prompt_token_ids, params), CompletionOutput(index=i))
            for i in range(params.n)
        ]
        for c in self.choices:
            if params.logprobs is not None:
                c.output.logprobs = [] if keep_logprobs else None
                c.output.cumulative_logprob = 0.0
        self.output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            outputs=[c.output for c in self.choices],
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=arrival),
        )

    @property
    def finished(self) -> bool:
        return all(c.finish is not None for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float | None = None,
        keep_logprobs: bool = True,
    ) -> None:
        """`keep_logprobs=False`: a streaming caller reads each step's logprobs from the deltas, so the output keeps
        none (`CompletionOutput.logprobs` stays None; `cumulative_logprob` is still summed).

        NOTE: n=16 with 20 logprobs holds ~7 MB per 200 steps as decoded dicts; a stream never reads them again."""
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival or time.monotonic(), keep_logprobs
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for c in state.choices:
            if c.finish is None:
                c.finish = FinishReason.ABORT
                c.output.finish_reason = FinishReason.ABORT.openai
        state.output.finished = True
        return state.output

    def process(self, outputs: list[SeqOutput]) -> ProcessedStep:
        step = ProcessedStep()
        touched: dict[str, RequestUpdate] = {}
        now = time.monotonic()
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:
                continue
            update = touched.get(out.request_id)
            if update is None:
                update = touched[out.request_id] = RequestUpdate(state.output, [])
            state.output.num_cached_tokens = max(state.output.num_cached_tokens, out.num_cached_tokens)
            state.output.num_draft_tokens = max(state.output.num_draft_tokens, out.num_draft_tokens)
            state.output.num_accepted_tokens = max(state.output.num_accepted_tokens, out.num_accepted_tokens)
            if out.prompt_logprobs is not None and state.output.prompt_logprobs is not None:
                state.output.prompt_logprobs.extend(self._positions(out.prompt_logprobs))
            choice = state.choices[out.index]
            if choice.finish is not None or (not out.new_token_ids and out.finish_reason is None):
                continue
            delta = self._apply(choice, out, state.params)
            metrics = state.output.metrics
            if metrics is not None and metrics.first_token_time is None and out.new_token_ids:
                metrics.first_token_time = now
            if delta.finish_reason is FinishReason.STOP_STRING and out.finish_reason is None:
                step.stops.append(StopMatch(out.request_id, out.index, str(delta.stop_reason)))
            update.deltas.append(delta)
        for request_id, update in touched.items():
            state = self.requests[request_id]
            if state.finished:
                state.output.finished = True
                if state.output.metrics is not None:
                    state.output.metrics.finished_time = now
                del self.requests[request_id]
            step.updates.append(update)
        return step

    def _apply(self, choice: _Choice, out: SeqOutput, params: SamplingParams) -> ChoiceDelta:
        o = choice.output
        stopped_by_token = out.finish_reason is FinishReason.STOP_TOKEN
        d = choice.detok.append(out.new_token_ids, stopped_by_token=stopped_by_token)
        text = d.text_delta
        o.token_ids.extend(out.new_token_ids)
        new_lps = self._positions(out.new_logprobs) if out.new_logprobs is not None else None
        if new_lps is not None and o.cumulative_logprob is not None:
            if o.logprobs is not None:
                o.logprobs.extend(new_lps)
            o.cumulative_logprob += sum(lp.logprobs[0] for lp in out.new_logprobs or [])
        finish, stop_reason = out.finish_reason, out.stop_reason
        if d.stop_string is not None:
            finish, stop_reason = FinishReason.STOP_STRING, d.stop_string
        if finish is not None:
            text += choice.detok.flush()
            choice.finish = finish
            o.finish_reason, o.stop_reason = finish.openai, stop_reason
        o.text = choice.detok.output_text
        return ChoiceDelta(o.index, list(out.new_token_ids), text, new_lps, finish, stop_reason)

    def _positions(self, items: list[TokenLogprobs]) -> list[PositionLogprobs]:
        result = []
        for item in items:
            pos: PositionLogprobs = {}
            for j, (tok, lp) in enumerate(zip(item.token_ids, item.logprobs, strict=True)):
                if tok in pos:
                    continue  # the chosen token is also among the top-k
                rank = item.rank if j == 0 else j
                pos[tok] = Logprob(lp, rank, self.tokenizer.decode([tok]))
            result.append(pos)
        return result
