"""The replicas' Stats as one: what the frontend's /metrics exports for the whole engine."""

from __future__ import annotations

from services.rpc import scheduler_pb2

_SUMMED = (
    "running",
    "waiting",
    "num_requests",
    "free_blocks",
    "total_blocks",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "steps",
    "step_seconds",
    "worker_seconds",
    "running_requests",
    "waiting_requests",
    "prefix_cache_evictions",
    "beam_search_requests",
    "beam_search_beams_forked",
    "beam_search_beams_pruned",
    "beam_search_live_beams",
)


def sum_stats(answers: list[scheduler_pb2.StatsResponse]) -> scheduler_pb2.StatsResponse:
    if len(answers) == 1:
        return answers[0]
    out = scheduler_pb2.StatsResponse()
    for name in _SUMMED:
        setattr(out, name, sum(getattr(a, name) for a in answers))
    out.kv_usage = 1.0 - out.free_blocks / out.total_blocks if out.total_blocks else 0.0
    out.prefix_cache_hit_rate = out.prefix_cache_hits / out.prefix_cache_queries if out.prefix_cache_queries else 0.0
    out.draining = all(a.draining for a in answers)
    return out
