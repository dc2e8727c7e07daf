"""One step's sampling with failures pinned to rows: a row that cannot be sampled fails its request alone.

The fast path samples every row at once. Only when that raises (a logits processor, or the sampler on one row's
parameters) are the rows sampled one at a time, each with its own metadata, so the failure lands on the rows that
cause it and their neighbours get the tokens they would have got (seeded rows draw the same noise: their RNG steps
are restored first). A row the sampler marks FAILED_TOKEN (no finite logit: NaN, +inf, everything masked) fails too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from engine_core.plan import LogprobsTensors
from engine_core.sample.sampler import FAILED_TOKEN, Sampler, SamplerOutput, compute_logprobs
from engine_core.sample.sampling_batch import SamplingBatch, SamplingMetadata

log = structlog.get_logger(__name__)

UNSAMPLEABLE = (
    "sampling failed: no token can be sampled (the logits are NaN or infinite, or the request's allowed_token_ids, "
    "bad_words and logit_bias leave no token)"
)


@dataclass
class StepSample:
    tokens: np.ndarray  # [rows] int64 on the host; FAILED_TOKEN where the row failed
    logprobs: LogprobsTensors | None
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> message, for every failed row


def batch_metadata(sampling: SamplingBatch, seq_ids: list[int]) -> SamplingMetadata | None:
    """The step's sampling metadata; None when building it raised (a processor failed to bind)."""
    try:
        return sampling.metadata(seq_ids)
    except Exception:
        log.exception("building the step's sampling metadata failed; sampling its rows one at a time")
        return None


def sample_step(
    sampler: Sampler,
    sampling: SamplingBatch,
    logits: torch.Tensor,
    seq_ids: list[int],
    meta: SamplingMetadata | None,
) -> StepSample:
    sampled = None if meta is None else _sample_all(sampler, logits, meta)
    if sampled is None:
        result = _sample_rows_alone(sampler, sampling, logits, seq_ids)
    else:
        tokens = sampled.sampled_token_ids
        host = tokens.cpu().numpy()
        sampling.append_tokens(seq_ids, tokens, host)
        result = StepSample(host, sampled.logprobs)
    return _fail_unsampled(result, seq_ids)


def picked_step(sampling: SamplingBatch, tokens: torch.Tensor, seq_ids: list[int]) -> StepSample:
    """An all-greedy step whose tokens the LM head picked (worker/head_step.py), FAILED_TOKEN already where a row's
    maximum logit is not finite (the sampler's greedy rule).

    NOTE: plain Python over the few rows rather than numpy or torch ops: after the head's code stream each op's
    first call runs from cold caches (fail_unsampleable measured ~150 us there, 8 us warm)."""
    host = tokens.numpy()
    sampling.append_tokens(seq_ids, tokens, host)
    failed = {seq_ids[i]: UNSAMPLEABLE for i, token in enumerate(host.tolist()) if token == FAILED_TOKEN}
    return StepSample(host, None, failed)


def _fail_unsampled(result: StepSample, seq_ids: list[int]) -> StepSample:
    for i in np.flatnonzero(result.tokens == FAILED_TOKEN):
        result.errors.setdefault(seq_ids[i], UNSAMPLEABLE)
    return result


def _sample_all(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput | None:
    """Every row at once; None when that raised, the seeded rows' RNG steps restored."""
    steps = {row: seeded.step for row, seeded in meta.generators.items()}
    try:
        return sampler(logits, meta)
    except Exception:
        log.exception("sampling the step failed; sampling its rows one at a time")
        for row, seeded in meta.generators.items():
            seeded.step = steps[row]
        return None


def _sample_rows_alone(
    sampler: Sampler, sampling: SamplingBatch, logits: torch.Tensor, seq_ids: list[int]
) -> StepSample:
    """Each row sampled, and its processors' state recorded, by itself; a row that raises fails alone."""
    tokens = np.full(len(seq_ids), FAILED_TOKEN, dtype=np.int64)
    errors: dict[int, str] = {}
    k: int | None = None
    for i, seq_id in enumerate(seq_ids):
        try:
            meta = sampling.metadata([seq_id])
            if meta.max_num_logprobs is not None:
                k = max(k or 0, meta.max_num_logprobs)
            token = sampler.sample(logits[i : i + 1], meta)
            host = token.cpu().numpy()
            if host[0] != FAILED_TOKEN:
                sampling.append_tokens([seq_id], token, host)
            tokens[i] = host[0]
        except Exception as e:
            log.exception("sampling a row failed", seq_id=seq_id)
            errors[seq_id] = f"sampling failed: {type(e).__name__}: {e}"
    logprobs = None
    if k is not None:
        # NOTE: logprobs are of the raw logits, so they do not depend on how the rows were sampled.
        logprobs = compute_logprobs(logits, torch.from_numpy(tokens).clamp_min(0).to(logits.device), k)
    return StepSample(tokens, logprobs, errors)
