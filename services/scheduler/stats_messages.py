"""The scheduler's counters as Protobuf: the Stats RPC's answer (also its /metrics) and the KV-event stream's load."""

from __future__ import annotations

from engine_core.stats import EngineStats
from services.rpc import scheduler_pb2
from services.scheduler.engine_loop import SchedulerStats


def stats_response(s: SchedulerStats, draining: bool) -> scheduler_pb2.StatsResponse:
    e = s.engine
    return scheduler_pb2.StatsResponse(
        running=e.running,
        waiting=e.waiting,
        num_requests=e.num_requests,
        free_blocks=e.free_blocks,
        total_blocks=e.total_blocks,
        kv_usage=e.kv_usage,
        prefix_cache_hit_rate=e.prefix_cache_hits / e.prefix_cache_queries if e.prefix_cache_queries else 0.0,
        prefix_cache_queries=e.prefix_cache_queries,
        prefix_cache_hits=e.prefix_cache_hits,
        preemptions=e.preemptions,
        prefix_cache_evictions=e.prefix_cache_evictions,
        steps=s.steps,
        draining=draining,
        step_seconds=s.step_seconds,
        worker_seconds=s.worker_seconds,
        running_requests=e.running_requests,
        waiting_requests=e.waiting_requests,
        spec_decode_num_drafts=e.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=e.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=e.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(e.spec_decode_num_accepted_tokens_per_pos),
        beam_search_requests=e.beam_search_requests,
        beam_search_beams_forked=e.beam_search_beams_forked,
        beam_search_beams_pruned=e.beam_search_beams_pruned,
        beam_search_live_beams=e.beam_search_live_beams,
    )


def kv_load(e: EngineStats) -> scheduler_pb2.KvLoad:
    return scheduler_pb2.KvLoad(
        running=e.running,
        waiting=e.waiting,
        kv_usage=e.kv_usage,
        running_requests=e.running_requests,
        waiting_requests=e.waiting_requests,
        free_blocks=e.free_blocks,
        total_blocks=e.total_blocks,
    )
