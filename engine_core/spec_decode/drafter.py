"""The scheduler's side of speculative decoding: which sequences get drafts this step, and how many.

The scheduler owns the tokens, so it proposes (n-gram lookup and the suffix cache need no model); the worker
verifies the drafts in the step's forward and returns the tokens it accepted plus one of its own. Adaptive in two
ways: a step with more running sequences than `disable_by_batch_size` proposes nothing, and a sequence whose drafts
were all rejected backs off (its next 1, 3, 7, ... up to MAX_BACKOFF chances draft at most BACKOFF_PROBE_TOKENS
tokens) until a draft is accepted again.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_core.sampling_params import SamplingParams
from engine_core.spec_decode.config import SpeculativeConfig
from engine_core.spec_decode.ngram import propose_ngram
from engine_core.spec_decode.stats import SpecDecodeStats
from engine_core.spec_decode.suffix_cache import SuffixCache

MAX_BACKOFF = 16
# NOTE: a backed-off chance still drafts this many tokens (a probe) instead of none: a 2-row step costs the coded
# kernel 1.13x a plain one, and on the input-grounded replay most skipped chances would have been accepted (the
# suffix method's plain steps 71 -> 30, est. 2.21x -> 2.32x); an accepted probe ends the back-off. docs/decisions.md,
# "Speculative decoding" (back-off probes).
BACKOFF_PROBE_TOKENS = 1


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly by sampling every position from the target alone.

    NOTE: the logits processors that read the output so far (penalties, bad_words, min_tokens) would have to see
    the drafts before them at each position, and allowed_token_ids / logit_bias share their bound form with those;
    a structured-output matcher would have to advance through the drafts and roll back the rejected ones. Such
    requests decode one token per step (their output is unchanged either way).
    """
    return (
        params.repetition_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and not params.logit_bias
        and not params.bad_words_token_ids
        and not params.allowed_token_ids
        and params.min_tokens == 0
        and params.structured_outputs is None
        and not params.use_beam_search  # NOTE: a beam's next token is its group's choice, not its own sample
    )


@dataclass
class _Backoff:
    misses: int = 0  # verification rows in a row that accepted nothing
    skip: int = 0  # chances left that only probe (draft at most BACKOFF_PROBE_TOKENS)


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodeStats()
        self._backoff: dict[int, _Backoff] = {}
        self.suffix: SuffixCache | None = None
        if config.method == "suffix":
            self.suffix = SuffixCache(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_max_cached_requests,
                config.suffix_decoding_max_spec_factor,
                config.suffix_decoding_min_token_prob,
            )

    def active(self, num_running: int) -> bool:
        """Whether a step with `num_running` sequences proposes at all."""
        return num_running <= self.config.disable_by_batch_size

    def propose(
        self,
        seq_id: int,
        token_ids: list[int],
        params: SamplingParams,
        room: int,
        cache_salt: str | None = None,
        proposal: list[int] | None = None,
    ) -> list[int]:
        """Drafts for the position after `token_ids` (at most `room`, what max_tokens, max_model_len and the step's
        token budget leave); [] when the sequence should decode one token. `cache_salt`: the request's tenant (the
        suffix method proposes from that tenant's cached outputs only). `proposal`: the worker's draft-model
        proposal for that position (draft_model method; None when it has none)."""
        k = min(self.config.num_speculative_tokens, room)
        if k < 1 or not can_speculate(params):
            return []
        backoff = self._backoff.get(seq_id)
        if backoff is not None and backoff.skip > 0:
            backoff.skip -= 1
            k = min(k, BACKOFF_PROBE_TOKENS)
        if self.suffix is not None:
            return self.suffix.propose(token_ids, cache_salt, k)
        if self.config.method == "draft_model":
            return list(proposal[:k]) if proposal else []
        return propose_ngram(token_ids, k, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def record(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """A verification row's result: `num_accepted` of `num_draft` drafts were accepted."""
        self.stats.record(num_draft, num_accepted)
        if num_accepted:
            self._backoff.pop(seq_id, None)
            return
        backoff = self._backoff.setdefault(seq_id, _Backoff())
        backoff.misses += 1
        backoff.skip = min((1 << backoff.misses) - 1, MAX_BACKOFF)

    def forget(self, seq_id: int, output_ids: list[int] | None = None, cache_salt: str | None = None) -> None:
        """A sequence ended; the suffix method caches its output (`output_ids`) for its tenant's later requests."""
        self._backoff.pop(seq_id, None)
        if self.suffix is not None and output_ids:
            self.suffix.add_output(output_ids, cache_salt)
