"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprobs of the prompt tokens a step's chunk predicts."""

from __future__ import annotations

import torch

from engine_core.model.llama import LlamaForCausalLM
from engine_core.plan import PromptLogprobs
from engine_core.sample.sampler import compute_logprobs
from engine_core.worker.input_batch import InputBatch, StepInputs


def prompt_logprobs(
    model: LlamaForCausalLM, batch: InputBatch, inputs: StepInputs, hidden: torch.Tensor, device: torch.device
) -> dict[int, PromptLogprobs]:
    """Logprobs of the prompt tokens this step's chunk predicts (only for sequences that asked)."""
    result: dict[int, PromptLogprobs] = {}
    for i, seq_id in enumerate(inputs.seq_ids):
        k = batch.params[seq_id].prompt_logprobs
        if k is None:
            continue
        row = int(inputs.rows[i])
        start, n = int(inputs.num_computed[i]), int(inputs.num_scheduled[i])
        # Position p predicts prompt token p + 1; only prompt tokens have prompt logprobs.
        end = min(start + n, int(batch.num_prompt[row]) - 1)
        if end <= start:
            continue
        offset = int(inputs.query_start_loc[i])
        logits = model.compute_logits(hidden[offset : offset + end - start])
        if logits is None:  # tensor parallelism: rank 0 reports them
            continue
        targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1]).to(device)
        result[seq_id] = PromptLogprobs(start=start + 1, tensors=compute_logprobs(logits, targets, k))
    return result
