"""The engine's own record of a request's life (RequestTimings): the data the services turn into spans."""

from __future__ import annotations

from engine_core.core.request import LifecycleKind
from tests.scheduler_sim import Harness, make_request, make_scheduler


def test_timings_are_ordered_and_steps_counted_once_per_step() -> None:
    h = Harness(make_scheduler(max_num_batched_tokens=4))
    req = h.add(make_request(list(range(10, 20)), max_tokens=3, n=2))
    h.run()
    t = req.timings
    assert t.first_scheduled is not None and t.first_token is not None and t.finished is not None
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    # 10 prompt tokens in chunks of 4 (the parent stops one short to fork: 4 + 4 + 1), then the two choices
    # decode together: a step serving both choices counts once.
    steps_with_req = sum(1 for p in h.plans if p.num_scheduled_tokens)
    assert t.num_steps == steps_with_req
    assert t.events == []  # never preempted


def test_preemption_and_resume_are_recorded_in_order() -> None:
    h = Harness(make_scheduler(num_blocks=6, max_model_len=24))
    old = h.add(make_request(list(range(10, 18)), max_tokens=12))
    new = h.add(make_request(list(range(20, 28)), max_tokens=12))
    h.run()
    assert old.timings.events == []
    events = new.timings.events
    victim = new.seqs[0]
    kinds = [e.kind for e in events]
    assert victim.num_preemptions >= 1
    assert kinds == [LifecycleKind.PREEMPTED, LifecycleKind.RESUMED] * victim.num_preemptions
    assert all(e.index == 0 for e in events)
    times = [e.time for e in events]
    assert times == sorted(times)
    assert new.timings.first_scheduled is not None and new.timings.finished is not None
    assert new.timings.first_scheduled <= times[0] and times[-1] <= new.timings.finished
    # preempted with its output so far; resumed with the same tokens
    assert events[0].num_tokens == events[1].num_tokens > 8
