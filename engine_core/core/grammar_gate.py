"""The compile gate of structured output (vLLM V1's WAITING_FOR_FSM): a request whose constraint is not compiled yet
waits here, outside the scheduler's queue, while the worker compiles it off its step thread; it joins the queue when
the worker reports the grammar ready, and fails alone when the compile fails or outlasts `deadline_s`.

NOTE: the scheduler has no tokenizer (the worker does, and the compiled grammar must end up in the worker's cache),
so the gate is a handshake on the step plan: `SchedulerOutput.grammars` asks, `ModelRunnerOutput.grammar_results`
answers. A key the worker reported ready is admitted at once next time (`ready_keys`, bounded like the worker's
cache): a cached constraint costs nothing at admission; one evicted from the worker's cache since is compiled there
on the step's thread (1-2 ms for a schema, benchmarks.md "Structured output").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from engine_core.core.request import Request, Sequence
from engine_core.plan import GrammarRequest
from engine_core.structured_output.backend import GRAMMAR_CACHE_SIZE


@dataclass
class _Held:
    request: Request
    seqs: list[Sequence]
    since: float  # time.monotonic() when it was held


@dataclass
class GateResult:
    """What one step's answers (and the clock) did: requests whose sequences may be queued, requests that failed."""

    ready: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)


class GrammarGate:
    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s  # EngineConfig.structured_outputs_compile_timeout
        self.held: dict[str, _Held] = {}  # request_id -> waiting for its grammar
        self._to_send: list[GrammarRequest] = []
        self._ready_keys: OrderedDict[tuple, None] = OrderedDict()  # compiled on the worker (as far as we know)

    def hold(self, request: Request, seqs: list[Sequence]) -> bool:
        """Whether the request must wait for its grammar (then it is held and its compile asked for)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        key = params.key
        if key in self._ready_keys:
            self._ready_keys.move_to_end(key)
            return False
        self.held[request.request_id] = _Held(request, seqs, time.monotonic())
        self._to_send.append(GrammarRequest(request.request_id, params))
        return True

    def drain(self) -> list[GrammarRequest]:
        """The compiles to ask the worker for in this plan."""
        out, self._to_send = self._to_send, []
        return out

    def release(self, request_id: str) -> None:
        """Forgets a request that ended while held (aborted): its compile may finish on the worker, unread."""
        if self.held.pop(request_id, None) is not None:
            self._to_send = [g for g in self._to_send if g.request_id != request_id]

    @property
    def num_seqs(self) -> int:
        return sum(len(h.seqs) for h in self.held.values())

    def settle(self, results: dict[str, str]) -> GateResult:
        """Applies the worker's answers, then the deadline to those still held."""
        out = GateResult()
        now = time.monotonic()
        for request_id, held in list(self.held.items()):
            # NOTE: the deadline first: an answer that comes later than the deadline does not count.
            if now - held.since >= self.deadline_s:
                del self.held[request_id]
                params = held.request.sampling_params.structured_outputs
                kind = params.kind.value if params is not None else "constraint"
                why = f"structured_outputs.{kind} did not compile within {self.deadline_s:g} s"
                out.failed.append((held.request, why))
                continue
            if request_id not in results:
                continue
            del self.held[request_id]
            error = results[request_id]
            if error:
                out.failed.append((held.request, error))
                continue
            params = held.request.sampling_params.structured_outputs
            assert params is not None
            self._ready_keys[params.key] = None
            if len(self._ready_keys) > GRAMMAR_CACHE_SIZE:
                self._ready_keys.popitem(last=False)
            out.ready += held.seqs
        return out
