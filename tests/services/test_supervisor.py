"""`pagoda serve`'s supervision (services/supervisor.py) over real child processes: a SIGKILLed worker is restarted
after its backoff, the backoff doubles while its restarts stay in the window, a process over the restart limit is
given up on, and a process that may not be restarted (the frontend) is reported at once. The clock is a counter the
test advances, so no assertion depends on how fast this machine is."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import LaunchConfig, LocalCluster
from services.rpc import WORKER_SERVICE
from services.supervisor import RestartPolicy, Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(LaunchConfig.on_loopback(log_dir=str(tmp_path)))
    for name in ("worker0", "frontend"):
        # NOTE: any long-lived process stands for a service here: the supervisor only watches and restarts it.
        c.spawn(name, "http.server", ["--bind", "127.0.0.1", "0"], "127.0.0.1:0", WORKER_SERVICE, {})
    yield c
    c.stop(timeout=5)


def kill(cluster: LocalCluster, name: str) -> None:
    proc = cluster.service(name).process
    proc.kill()
    proc.wait(10)


def test_a_killed_worker_comes_back_after_a_doubling_backoff_until_the_limit(cluster: LocalCluster) -> None:
    clock = Clock()
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, max_restarts=3, window_s=100.0)
    sup = Supervisor(cluster, lambda name: name.startswith("worker"), policy, clock)
    worker = cluster.service("worker0")
    for attempt, delay in enumerate([1.0, 2.0, 3.0]):  # doubled, capped at max_backoff_s
        first = worker.process
        kill(cluster, "worker0")
        assert sup.check() == []  # dead: its restart is due after the backoff
        clock.now += delay - 0.5
        assert sup.check() == [] and worker.process is first
        clock.now += 0.5
        assert sup.check() == []
        assert worker.process is not first and worker.process.poll() is None, "restarted"
        assert worker.restarts == attempt + 1
    kill(cluster, "worker0")
    assert sup.check() == ["worker0"]  # a fourth death within the window: given up
    assert worker.process.poll() is not None


def test_restarts_outside_the_window_do_not_count(cluster: LocalCluster) -> None:
    clock = Clock()
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=8.0, max_restarts=1, window_s=10.0)
    sup = Supervisor(cluster, lambda name: name.startswith("worker"), policy, clock)
    kill(cluster, "worker0")
    sup.check()
    clock.now += 1.0
    sup.check()
    assert cluster.service("worker0").restarts == 1
    clock.now += 11.0  # the first restart leaves the window
    kill(cluster, "worker0")
    assert sup.check() == []
    clock.now += 1.0  # back to the first backoff
    assert sup.check() == []
    assert cluster.service("worker0").restarts == 2


def test_a_process_that_may_not_be_restarted_is_reported_at_once(cluster: LocalCluster) -> None:
    sup = Supervisor(cluster, lambda name: name.startswith("worker"), RestartPolicy(), Clock())
    kill(cluster, "frontend")
    assert sup.check() == ["frontend"]
    assert cluster.service("worker0").process.poll() is None
