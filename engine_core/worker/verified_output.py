"""The output of a step with drafts: each verified row emits its accepted drafts and the target's own token, as
consecutive `ModelRunnerOutput` rows of its seq_id (spec_verify.py accepts, this writes them out)."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.plan import LogprobsTensors, ModelRunnerOutput
from engine_core.sample.sampler import FAILED_TOKEN
from engine_core.sample.sampling_batch import SamplingBatch
from engine_core.worker.input_batch import InputBatch, StepInputs
from engine_core.worker.spec_verify import Verification, advance_verified
from engine_core.worker.step_sampling import StepSample


def emit_verified(
    out: ModelRunnerOutput,
    verify: Verification,
    inputs: StepInputs,
    sample_idx: np.ndarray,
    sampled: StepSample,
    batch: InputBatch,
    sampling: SamplingBatch,
) -> ModelRunnerOutput:
    """A step with drafts: each verified row emits its accepted drafts and the target's own token."""
    keep, accepted = verify.accept(sampled.tokens)
    tokens = sampled.tokens[keep]
    advance_verified(batch, inputs, sample_idx, np.where(tokens == FAILED_TOKEN, 0, tokens), accepted, verify.drafts)
    for seq_id, row_drafts, a in zip(verify.seq_ids, verify.drafts, accepted, strict=True):
        if len(row_drafts) > a:
            sampling.rewind_seeded(seq_id, len(row_drafts) - a)
    out.seq_ids = [verify.row_seq_ids[i] for i in keep.tolist()]
    out.sampled_token_ids = tokens.tolist()
    lp = sampled.logprobs
    if lp is not None:
        index = torch.from_numpy(keep).to(lp.token_ids.device)
        out.logprobs = LogprobsTensors(lp.token_ids[index], lp.logprobs[index], lp.ranks[index])
    return out
