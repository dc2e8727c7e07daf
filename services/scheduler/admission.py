"""What the scheduler admits: a submission's checks before it reaches the engine, and the refusal's gRPC status."""

from __future__ import annotations

from engine_core.core.prompt_checks import check_token_ids
from engine_core.core.request import Request
from engine_core.engine import EngineCore
from services.common.trace import TraceContext
from services.convert.params import params_from_proto
from services.convert.ranges import check_wire_ranges
from services.rpc import scheduler_pb2


class Refused(Exception):
    """A request not admitted: the gRPC status name it ends with and the message (naming the field)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def engine_request(request: scheduler_pb2.SubmitRequest, scoped_id: str, vocab_size: int, core: EngineCore) -> Request:
    """The engine's request for a submission whose sampling options, prompt and sizes pass the engine's own limits;
    raises Refused (INVALID_ARGUMENT) otherwise, so a bad request fails its call instead of the engine thread."""
    try:
        params = params_from_proto(request.sampling, internal=True)
        params.validate_vocab(vocab_size)
        check_wire_ranges(params)  # NOTE: seed + n - 1 must fit the step message's int64
        check_token_ids(request.prompt_token_ids, vocab_size)
        # NOTE: frozen RequestLimits, so safe to read from the event loop's thread.
        core.check_request(len(request.prompt_token_ids), params.n)
        if params.use_beam_search:
            width = params.n if params.beam_width is None else params.beam_width
            core.limits.check_beam(len(request.prompt_token_ids), width, params.max_tokens)
    except ValueError as e:
        raise Refused("INVALID_ARGUMENT", str(e)) from e
    return Request(
        request_id=scoped_id,
        prompt_token_ids=list(request.prompt_token_ids),
        sampling_params=params,
        priority=request.priority,
        cache_salt=request.cache_salt or None,
        trace_context=TraceContext.from_proto(request.trace).as_dict(),
    )
