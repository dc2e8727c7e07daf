"""A snapshot of the engine's state for metrics and the Stats RPC."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """What `EngineCore.stats()` reports; frozen, so a reader on another thread sees one consistent snapshot."""

    running: int = 0  # sequences
    waiting: int = 0  # sequences
    num_requests: int = 0  # unfinished requests
    free_blocks: int = 0
    total_blocks: int = 0
    kv_usage: float = 0.0  # fraction of blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    preemptions: int = 0
    prefix_cache_evictions: int = 0  # cached blocks reused for other content (their hash dropped)
    running_requests: int = 0  # requests with a choice running (vLLM's num_requests_running)
    waiting_requests: int = 0  # unfinished requests none of whose choices runs (vLLM's num_requests_waiting)
    # Speculative decoding (vLLM's spec_decode_* counters): verification rows, drafts, accepted drafts, accepted per
    # draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Beam search (vLLM has no such metrics): searches added, beams forked and pruned since start; beams live now.
    beam_search_requests: int = 0
    beam_search_beams_forked: int = 0
    beam_search_beams_pruned: int = 0
    beam_search_live_beams: int = 0
