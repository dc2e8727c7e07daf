"""Decode steps that run the LM head inside the native step, picked per step by the model runner.

An int8 model's decode-only step below its W8A8 rows can run the final norm and the LM head in the native call's last
parallel region (`NativeDecodeStep.with_head`, kernels/cpu/decode_int8.cpp): the head's codes stream on from the last
layer's without a cold restart or a return to Python. Where the step is all greedy and nothing else reads the logits
(no logits processor that can move an argmax, no logprobs), the head also picks each row's token as it computes the
logits and never writes them, so the sampler's pass over them (read back from DRAM, the head's code stream having
evicted them) is gone too. Every other step, and every step something needs the hidden states for (prompt logprobs,
speculative decoding's verification rows), takes the unfused path: step function, `compute_logits`, the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.model.native_decode import HeadOutput, NativeDecodeStep
from engine_core.sample.sampling_batch import SamplingMetadata
from engine_core.worker.step_functions import StepFunction, is_decode_only


@dataclass
class FusedHead:
    """This step's forward through the LM head: its logits, or with `greedy` only its greedy tokens."""

    step: NativeDecodeStep
    greedy: bool

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> HeadOutput:
        return self.step.with_head(input_ids, positions, kv_caches, meta, self.greedy)


def greedy_pick_suffices(sampling: SamplingMetadata | None) -> bool:
    """Whether the sampler would take each row's first maximal logit and read nothing else of the logits: every row
    greedy, no processor that can move an argmax (masks, biases, penalties, grammars), no logprobs."""
    return (
        sampling is not None
        and sampling.all_greedy
        and not sampling.argmax_processors
        and sampling.max_num_logprobs is None
    )


def fused_head(
    step: StepFunction,
    meta: AttentionMetadata,
    sampled_rows: int,
    sampling: SamplingMetadata | None,
    needs_hidden: bool,
) -> FusedHead | None:
    """The fused head for this step, or None for the unfused path. `step`: the runner's pick for it; `sampled_rows`:
    how many rows sample (the fused head's logits are every row's, in row order); `needs_hidden`: something reads the
    step's hidden states (prompt logprobs, verification rows)."""
    if not isinstance(step, NativeDecodeStep) or needs_hidden or not is_decode_only(meta):
        return None
    if sampled_rows != meta.num_tokens or not step.fuses_head(meta.num_tokens):
        return None
    return FusedHead(step, greedy_pick_suffices(sampling))
