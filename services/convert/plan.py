"""The engine's per-step plan and the worker's results <-> Protobuf (worker.proto)."""

from __future__ import annotations

import numpy as np

from engine_core.plan import (
    BeamDelta,
    CachedSequenceData,
    GrammarRequest,
    LogprobsTensors,
    ModelRunnerOutput,
    NewSequenceData,
    PromptLogprobs,
    SchedulerOutput,
)
from services.convert.params import params_from_proto, params_to_proto
from services.convert.structured_outputs import structured_outputs_from_proto, structured_outputs_to_proto
from services.rpc import common_pb2, worker_pb2


def plan_to_proto(plan: SchedulerOutput, *, epoch: str, step: int) -> worker_pb2.ExecuteRequest:
    msg = worker_pb2.ExecuteRequest(
        epoch=epoch,
        step=step,
        scheduled_seq_ids=list(plan.num_scheduled_tokens),
        num_scheduled_tokens=list(plan.num_scheduled_tokens.values()),
        finished_seq_ids=plan.finished_seq_ids,
        copy_src=[s for s, _ in plan.copy_blocks],
        copy_dst=[d for _, d in plan.copy_blocks],
    )
    for seq_id, drafts in plan.scheduled_spec_decode_tokens.items():
        msg.spec_decode_tokens.add(seq_id=seq_id, token_ids=drafts)
    for d in plan.beam_deltas:
        msg.beam_deltas.add(seq_id=d.seq_id, parent_seq_id=d.parent_seq_id, token=d.token, block_ids=d.block_ids)
    for g in plan.grammars:
        structured_outputs_to_proto(g.params, msg.grammars.add(request_id=g.request_id).constraint)
    for new in plan.new_seqs:
        seq = msg.new_seqs.add(
            seq_id=new.seq_id,
            token_ids=new.token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
            sampling=params_to_proto(new.sampling_params, with_stop_strings=False),
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            request_id=new.request_id,
            trace=common_pb2.TraceContext(traceparent=new.trace_context, tracestate=new.trace_state),
        )
        if new.seed is not None:
            seq.seed = new.seed
    for cached in plan.cached_seqs:
        msg.cached_seqs.add(
            seq_id=cached.seq_id, new_block_ids=cached.new_block_ids, num_computed_tokens=cached.num_computed_tokens
        )
    return msg


def plan_from_proto(msg: worker_pb2.ExecuteRequest) -> SchedulerOutput:
    plan = SchedulerOutput(
        new_seqs=[
            NewSequenceData(
                seq_id=s.seq_id,
                token_ids=list(s.token_ids),
                num_prompt_tokens=s.num_prompt_tokens,
                sampling_params=params_from_proto(s.sampling, internal=True),
                seed=s.seed if s.HasField("seed") else None,
                block_ids=list(s.block_ids),
                num_computed_tokens=s.num_computed_tokens,
                request_id=s.request_id,
                trace_context=s.trace.traceparent,
                trace_state=s.trace.tracestate,
            )
            for s in msg.new_seqs
        ],
        cached_seqs=[
            CachedSequenceData(c.seq_id, list(c.new_block_ids), c.num_computed_tokens) for c in msg.cached_seqs
        ],
        num_scheduled_tokens=dict(zip(msg.scheduled_seq_ids, msg.num_scheduled_tokens, strict=True)),
        finished_seq_ids=list(msg.finished_seq_ids),
        copy_blocks=list(zip(msg.copy_src, msg.copy_dst, strict=True)),
        scheduled_spec_decode_tokens={d.seq_id: list(d.token_ids) for d in msg.spec_decode_tokens},
        beam_deltas=[BeamDelta(d.seq_id, d.parent_seq_id, d.token, list(d.block_ids)) for d in msg.beam_deltas],
        grammars=[GrammarRequest(g.request_id, structured_outputs_from_proto(g.constraint)) for g in msg.grammars],
    )
    plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
    return plan


def _matrix_to_proto(t: LogprobsTensors, out: worker_pb2.LogprobsMatrix) -> None:
    rows, cols = t.token_ids.shape
    out.rows, out.cols = rows, cols
    out.token_ids.extend(t.token_ids.reshape(-1).tolist())
    out.logprobs.extend(t.logprobs.reshape(-1).tolist())
    out.ranks.extend(t.ranks.reshape(-1).tolist())


def _matrix_from_proto(m: worker_pb2.LogprobsMatrix) -> LogprobsTensors:
    # NOTE: numpy, not torch: this runs in the scheduler, which never loads torch (~2 s of CPU and ~200 MB at start).
    shape = (m.rows, m.cols)
    return LogprobsTensors(
        token_ids=np.array(m.token_ids, dtype=np.int64).reshape(shape),
        logprobs=np.array(m.logprobs, dtype=np.float32).reshape(shape),
        ranks=np.array(m.ranks, dtype=np.int64),
    )


def result_to_proto(out: ModelRunnerOutput) -> worker_pb2.ExecuteResponse:
    msg = worker_pb2.ExecuteResponse(seq_ids=out.seq_ids, sampled_token_ids=out.sampled_token_ids, errors=out.errors)
    if out.logprobs is not None:
        _matrix_to_proto(out.logprobs, msg.logprobs)
    for seq_id, plp in out.prompt_logprobs.items():
        _matrix_to_proto(plp.tensors, msg.prompt_logprobs.add(seq_id=seq_id, start=plp.start).tensors)
    for seq_id, drafts in out.draft_token_ids.items():
        msg.draft_token_ids.add(seq_id=seq_id, token_ids=drafts)
    for request_id, error in out.grammar_results.items():
        msg.grammar_results.add(request_id=request_id, error=error)
    return msg


def result_from_proto(msg: worker_pb2.ExecuteResponse) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        seq_ids=list(msg.seq_ids),
        sampled_token_ids=list(msg.sampled_token_ids),
        logprobs=_matrix_from_proto(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs={p.seq_id: PromptLogprobs(p.start, _matrix_from_proto(p.tensors)) for p in msg.prompt_logprobs},
        errors=dict(msg.errors),
        draft_token_ids={d.seq_id: list(d.token_ids) for d in msg.draft_token_ids},
        grammar_results={g.request_id: g.error for g in msg.grammar_results},
    )
