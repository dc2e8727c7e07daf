"""`pagoda serve`'s process supervision: a dead worker (or, with replicas, scheduler) is restarted, as Kubernetes
restarts a dead pod, with an exponential backoff and a limit on restarts within a window.

The scheduler does the rest: it notices the dead rank (a failed step, or the heartbeat when idle), waits for it and
re-forms the group, and the streams the rank held resume (services/scheduler/failover.py). A process that keeps dying
(more than `max_restarts` in `window_s`: a bad model path, a poison input the scheduler has not yet failed, a broken
machine) is given up on, so `pagoda serve` exits rather than crash-looping forever.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from services.launcher import LocalCluster

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # before the first restart; doubled for each restart still in the window
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # within `window_s`; one more death and the supervisor gives up
    window_s: float = 300.0

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2.0**recent)


@dataclass
class _Track:
    restarts: deque[float] = field(default_factory=deque)  # when each restart in the window happened
    due: float | None = None  # the pending restart's time (the process is dead and waits out its backoff)


class Supervisor:
    """Call `check` periodically: it restarts the dead processes that `restartable` accepts once their backoff has
    passed, and returns the names of those it gives up on (not restartable, or over the restart limit)."""

    def __init__(
        self,
        cluster: LocalCluster,
        restartable: Callable[[str], bool],
        policy: RestartPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.restartable = restartable
        self.policy = policy or RestartPolicy()
        self.clock = clock
        self._tracks: dict[str, _Track] = {}

    def check(self) -> list[str]:
        now = self.clock()
        gave_up: list[str] = []
        for service in self.cluster.services:
            code = service.process.poll()
            if code is None:
                continue
            name = service.name
            if not self.restartable(name):
                gave_up.append(name)
                continue
            track = self._tracks.setdefault(name, _Track())
            while track.restarts and now - track.restarts[0] > self.policy.window_s:
                track.restarts.popleft()
            if track.due is None:
                if len(track.restarts) >= self.policy.max_restarts:
                    log.error(
                        "process keeps dying: giving up",
                        service=name,
                        exit_code=code,
                        restarts=len(track.restarts),
                        window_s=self.policy.window_s,
                    )
                    gave_up.append(name)
                    continue
                delay = self.policy.delay(len(track.restarts))
                track.due = now + delay
                log.warning("process exited: restarting it", service=name, exit_code=code, delay_s=delay)
            if now >= track.due:
                track.due = None
                track.restarts.append(now)
                self.cluster.restart(name)
                log.info("process restarted", service=name, restarts_in_window=len(track.restarts))
        return gave_up
