"""The typed messages between the scheduler and the model runner (per step), as deltas.

A remote worker can execute a `SchedulerOutput` from these fields alone: a sequence arrives once in full
(`NewSequenceData`), afterwards only its new block ids and token counts (`CachedSequenceData`). The worker keeps
the token ids it sampled itself, so decode steps carry no token ids at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.sampling_params import SamplingParams
from engine_core.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass
class NewSequenceData:
    """A sequence the worker has not seen (or must rebuild after preemption)."""

    seq_id: int
    token_ids: list[int]  # prompt + any output so far (non-empty output only when resumed after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None  # per-sequence seed (request seed + choice index), None for the shared generator
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose K/V already sit in `block_ids` (prefix-cache hit or fork)
    # Who the sequence is for, so the worker can attribute its work (logs, tracing) without asking back.
    request_id: str = ""
    trace_context: str = ""  # the W3C traceparent the request came with ("" when none)
    trace_state: str = ""  # the W3C tracestate that came with it ("" when none)


@dataclass
class CachedSequenceData:
    """A sequence the worker already holds: only what changed."""

    seq_id: int
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step, as the scheduler sees it


@dataclass
class BeamDelta:
    """Beam search re-forming a group (core/beam_group.py): sequence `seq_id` continues from `parent_seq_id` with
    `token` in place of the token the worker sampled. `seq_id == parent_seq_id`: the row keeps its place and only its
    last token changes; otherwise a new row copies the parent's tokens with `block_ids` as its block table (the
    parent's full blocks shared, the partial one a copy listed in `copy_blocks`)."""

    seq_id: int
    parent_seq_id: int
    token: int
    block_ids: list[int] = field(default_factory=list)


@dataclass
class GrammarRequest:
    """A request's constraint for the worker to compile off its step thread (core/grammar_gate.py); the request
    waits in the scheduler until the worker reports it in `ModelRunnerOutput.grammar_results`."""

    request_id: str
    params: StructuredOutputsParams


@dataclass
class SchedulerOutput:
    """One step's plan. `num_scheduled_tokens` orders the batch: the worker runs sequences in this order."""

    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Sequences the worker must forget (finished, aborted or preempted since the last step).
    finished_seq_ids: list[int] = field(default_factory=list)
    # Copy-on-write of shared partial blocks (src, dst), applied before the forward pass.
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding (vLLM's name): seq_id -> draft tokens to verify after its last known token; each is
    # counted in the sequence's num_scheduled_tokens (1 + len(drafts) query tokens).
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # Beam search: rows re-parented since the last step, applied before `finished_seq_ids` (a parent may leave in
    # the same plan its child forks from it).
    beam_deltas: list[BeamDelta] = field(default_factory=list)
    # Structured output: constraints to compile in the background, for requests held until they are ready.
    grammars: list[GrammarRequest] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsTensors:
    """Per sampled row: `token_ids[:, 0]` is the sampled token, the rest are the top-k alternatives.

    torch tensors where the sampler made them; numpy arrays where the scheduler decoded them from a worker's reply
    (services/convert/plan.py: the scheduler does not load torch). Both index and `.tolist()` alike (`tensor_rows`).
    """

    token_ids: torch.Tensor | np.ndarray  # [rows, 1 + k] int64
    logprobs: torch.Tensor | np.ndarray  # [rows, 1 + k] float32
    ranks: torch.Tensor | np.ndarray  # [rows] int64, rank of the sampled token (1 = most likely)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens [start, start + rows) of one sequence, computed in one prefill chunk."""

    start: int
    tensors: LogprobsTensors


@dataclass
class ModelRunnerOutput:
    """What the worker returns: one row per token sampled for a sequence that reached the end of its known tokens.

    A sequence that verified drafts has consecutive rows (same seq_id): its accepted drafts, then the token the
    target sampled itself (1 + accepted rows); every other sequence has one row.
    """

    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)  # -1 where the row failed (see `errors`)
    # Rows aligned with seq_ids, k = the largest `logprobs` asked in the batch; None when nobody asked.
    logprobs: LogprobsTensors | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    # Rows that failed alone (their sampling or a logits processor raised, or no token could be sampled): seq_id ->
    # message. The scheduler ends those sequences with an error; the step's other rows are unaffected.
    errors: dict[int, str] = field(default_factory=dict)
    # Speculative decoding (draft_model): seq_id -> the draft model's proposal for the sequence's next step, made
    # after this step's tokens; the scheduler schedules it as `scheduled_spec_decode_tokens` (or a prefix of it).
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Compiles of `SchedulerOutput.grammars` finished since the last step: request_id -> "" (ready) or why not.
    grammar_results: dict[str, str] = field(default_factory=dict)
