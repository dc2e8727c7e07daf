"""The public gRPC `Generation` service: Protobuf <-> the shared request path."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from engine_core.io.output_processor import ChoiceDelta
from engine_core.io.request_output import PositionLogprobs
from services.common.trace import TraceContext
from services.convert.outputs import reason_to_proto, stop_to_proto
from services.convert.params import params_from_proto
from services.frontend.auth import ApiKeys
from services.frontend.limits import ApiLimits
from services.frontend.pipeline import RequestPipeline
from services.frontend.request import ChatMessage, ErrorCode, GenerateInput, PromptInput, RequestError, StreamEvent
from services.frontend.slow_clients import DEFAULT_STREAM_SEND_TIMEOUT, SendWatchdog
from services.rpc import common_pb2, generation_pb2, generation_pb2_grpc

GRPC_CODES = {code: getattr(grpc.StatusCode, code.value) for code in ErrorCode}


def _chat(chat: generation_pb2.ChatInput) -> tuple[list[ChatMessage], bool]:
    messages = [ChatMessage(m.role, m.content) for m in chat.messages]
    return messages, chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True


def prompt_from_proto(msg: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest) -> PromptInput:
    kind = msg.WhichOneof("input")
    special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
    if kind == "text":
        return PromptInput(text=msg.text, add_special_tokens=special, field="text")
    if kind == "chat":
        messages, add_gen = _chat(msg.chat)
        return PromptInput(messages=messages, add_generation_prompt=add_gen, field="chat.messages")
    if kind == "token_ids":
        return PromptInput(token_ids=list(msg.token_ids.ids), field="token_ids")
    raise RequestError.invalid("input is required: set one of text, chat or token_ids", "input")


def input_from_proto(msg: generation_pb2.GenerateRequest, trace: TraceContext, tenant: str = "") -> GenerateInput:
    if msg.sampling.HasField("eos_token_id"):
        raise RequestError.invalid("sampling.eos_token_id is set by the server from the model; leave it unset")
    if msg.sampling.bad_words_token_ids:
        raise RequestError.invalid(
            "sampling.bad_words_token_ids is set by the server from bad_words; leave it unset",
            "sampling.bad_words_token_ids",
        )
    try:
        params = params_from_proto(msg.sampling)
    except ValueError as e:
        raise RequestError.invalid(f"sampling.{e}", f"sampling.{str(e).split(' ', 1)[0]}") from e
    return GenerateInput(
        prompt=prompt_from_proto(msg),
        params=params,
        request_id=msg.request_id or None,
        priority=msg.priority,
        cache_salt=msg.cache_salt or None,
        trace=trace,
        tenant=tenant,
    )


def _positions(items: list[PositionLogprobs | None]) -> list[generation_pb2.PositionLogprobs]:
    out = []
    for pos in items:
        msg = generation_pb2.PositionLogprobs()
        for tok, lp in (pos or {}).items():
            msg.entries.add(token_id=tok, logprob=lp.logprob, rank=lp.rank or 0, token=lp.decoded_token or "")
        out.append(msg)
    return out


def _delta(d: ChoiceDelta) -> generation_pb2.ChoiceDelta:
    msg = generation_pb2.ChoiceDelta(
        index=d.index, token_ids=d.token_ids, text=d.text, finish_reason=reason_to_proto(d.finish_reason)
    )
    if d.logprobs is not None:
        msg.logprobs.extend(_positions(list(d.logprobs)))
    stop_to_proto(d.stop_reason, msg.stop_reason)
    return msg


def response_from_event(event: StreamEvent, prompt_token_ids: list[int]) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(request_id=event.request_id, choices=[_delta(d) for d in event.deltas])
    if event.first:
        msg.prompt_token_ids.extend(prompt_token_ids)
    if event.prompt_logprobs:
        msg.prompt_logprobs.extend(_positions(event.prompt_logprobs))
        msg.prompt_logprobs_start = event.prompt_logprobs_start
    final = event.final
    if final is not None:
        f = msg.final
        for c in final.output.outputs:
            summary = f.choices.add(index=c.index, completion_tokens=len(c.token_ids))
            summary.finish_reason = _reason_from_openai(c.finish_reason, c.stop_reason)
            stop_to_proto(c.stop_reason, summary.stop_reason)
            if c.cumulative_logprob is not None:
                summary.cumulative_logprob = c.cumulative_logprob
        f.usage.prompt_tokens = final.usage.prompt_tokens
        f.usage.completion_tokens = final.usage.completion_tokens
        f.usage.cached_prompt_tokens = final.usage.cached_tokens
        f.timings.queue_s, f.timings.ttft_s, f.timings.e2e_s = (
            final.timings.queue_s,
            final.timings.ttft_s,
            final.timings.e2e_s,
        )
        f.error = final.error
    return msg


def _reason_from_openai(reason: str | None, stop: int | str | None) -> int:
    """CompletionOutput keeps the OpenAI string ("stop" for both kinds of stop); the stop value tells them apart."""
    if reason == "stop":
        return common_pb2.FINISH_REASON_STOP_STRING if isinstance(stop, str) else common_pb2.FINISH_REASON_STOP_TOKEN
    return {
        "length": common_pb2.FINISH_REASON_LENGTH,
        "abort": common_pb2.FINISH_REASON_ABORT,
        "error": common_pb2.FINISH_REASON_ERROR,
    }.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves once `pipeline` is set (the tokenizer loaded and the scheduler ready); UNAVAILABLE before."""

    def __init__(
        self,
        keys: ApiKeys | None = None,
        limits: ApiLimits | None = None,
        send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT,
    ) -> None:
        self.pipeline: RequestPipeline | None = None
        self.keys = keys or ApiKeys([])
        self.limits = limits or ApiLimits()
        self.send_timeout = send_timeout  # seconds the client has to take each message (slow_clients)

    def _ready(self, context: grpc.aio.ServicerContext) -> tuple[RequestPipeline, str]:
        """The pipeline and the caller's tenant (UNAUTHENTICATED first: no state is revealed to a stranger)."""
        tenant = self.keys.tenant(context.invocation_metadata())
        if self.pipeline is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "the frontend is starting (waiting for the scheduler)")
        return self.pipeline, tenant

    def _trace(self, context: grpc.aio.ServicerContext) -> TraceContext:
        trace = TraceContext.from_metadata(context.invocation_metadata())
        return TraceContext(trace.traceparent, self.limits.tracestate(trace.tracestate))

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            pipeline, tenant = self._ready(context)
            prepared = await pipeline.prepare(input_from_proto(request, self._trace(context), tenant))
            # NOTE: closed on the way out, before the status is sent: a stalled client's request is aborted at once.
            async with (
                contextlib.aclosing(pipeline.stream(prepared)) as events,
                SendWatchdog(self.send_timeout, prepared.request_id) as watchdog,
            ):
                async for event in events:
                    await watchdog.send(context.write(response_from_event(event, prepared.prompt_token_ids)))
        except RequestError as e:
            # NOTE: the status queues behind the unread messages; a client that never reads again must not hold
            # this handler (gRPC still delivers the status if the client comes back).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.send_timeout):
                    await context.abort(GRPC_CODES[e.code], e.message)
        return
        # NOTE: sends with context.write (a yield cannot have a deadline); still an async generator, because
        # OpenTelemetry's server interceptor iterates streaming handlers.
        yield

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        try:
            pipeline, tenant = self._ready(context)
            # NOTE: the caller's own `owner` field is ignored: ownership comes from its API key only.
            return common_pb2.AbortResponse(found=await pipeline.abort(request.request_id, tenant))
        except RequestError as e:
            await context.abort(GRPC_CODES[e.code], e.message)
            raise  # unreachable: abort raises

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        try:
            pipeline, _ = self._ready(context)
            prompt = prompt_from_proto(request)
            self.limits.check_prompt(prompt)
            _, ids = await pipeline.encode(prompt, check_length=False)
        except RequestError as e:
            await context.abort(GRPC_CODES[e.code], e.message)
            raise
        tok = pipeline.tokenizer
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=tok.tokens(ids), max_model_len=tok.max_model_len)

    async def ModelInfo(
        self, request: generation_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfoResponse:
        try:
            m = self._ready(context)[0].model
        except RequestError as e:
            await context.abort(GRPC_CODES[e.code], e.message)
            raise
        resp = generation_pb2.ModelInfoResponse(
            model=m.name,
            architecture=m.architecture,
            max_model_len=m.max_model_len,
            vocab_size=m.vocab_size,
            block_size=m.block_size,
            num_kv_blocks=m.num_kv_blocks,
            has_chat_template=m.has_chat_template,
        )
        if m.eos_token_id is not None:
            resp.eos_token_id = m.eos_token_id
        return resp
