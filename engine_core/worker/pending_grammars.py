"""The worker's side of the compile gate: the constraints a plan asked it to compile (`SchedulerOutput.grammars`),
compiling on the backend's compile thread while steps run, reported once done (`ModelRunnerOutput.grammar_results`).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from engine_core.plan import GrammarRequest
from engine_core.structured_output.backend import StructuredOutputBackend

# An empty step (nothing runs but compiles) waits this long for one to finish, so the engine does not spin.
IDLE_WAIT_S = 0.02
NO_BACKEND = "structured output is unavailable: the model has no tokenizer.json"


class PendingGrammars:
    def __init__(self, backend: StructuredOutputBackend | None) -> None:
        self.backend = backend
        self._futures: dict[str, Future[None]] = {}  # request_id -> its compile, until reported
        self._failed: dict[str, str] = {}  # request_id -> why, known without compiling

    def __bool__(self) -> bool:
        return bool(self._futures or self._failed)

    def submit(self, requests: list[GrammarRequest]) -> None:
        for req in requests:
            if self.backend is None:
                self._failed[req.request_id] = NO_BACKEND
            else:
                self._futures[req.request_id] = self.backend.prepare(req.params)

    def poll(self, wait_s: float = 0.0) -> dict[str, str]:
        """The compiles done (request_id -> "" or the error), forgotten once returned. `wait_s`: how long to wait for
        the first one (a step with nothing else to do, so the scheduler does not spin on empty steps)."""
        if wait_s > 0 and self._futures and not self._failed:
            wait(self._futures.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        done, self._failed = self._failed, {}
        for request_id, future in list(self._futures.items()):
            if future.done():
                del self._futures[request_id]
                error = future.exception()
                done[request_id] = "" if error is None else str(error) or type(error).__name__
        return done
