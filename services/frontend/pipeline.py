"""The one request path of the frontend: validate, tokenize, submit to the scheduler, detokenize, stream.

The gRPC `Generation` service and the OpenAI HTTP routes both turn their requests into a `GenerateInput` and
consume `StreamEvent`s from here, so they validate, stop and count tokens identically. Detokenization and stop
strings are engine_core's `OutputProcessor`, as in the offline `LLM`; a stop-string match is sent to the
scheduler (`FinishChoice`) so the choice's blocks are freed there too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import structlog

from engine_core.io.output_processor import OutputProcessor, StopMatch
from engine_core.io.request_output import RequestOutput
from engine_core.sampling_params import with_eos
from services.common.logs import request_fields
from services.common.request_scope import scoped_request_id
from services.common.telemetry import Telemetry
from services.common.timeutil import now_ns
from services.common.trace import TraceContext
from services.convert.outputs import seq_output_from_proto
from services.convert.params import params_to_proto
from services.frontend.limits import ApiLimits
from services.frontend.metrics import Rejection, RequestMetrics
from services.frontend.request import (
    ErrorCode,
    FinalInfo,
    GenerateInput,
    ModelDescription,
    PreparedRequest,
    PromptInput,
    RequestError,
    StreamEvent,
    Timings,
    Usage,
)
from services.frontend.router import RoutedCall, SchedulerRouter
from services.frontend.scheduler_client import SchedulerClient, rpc_error
from services.frontend.scheduler_stream import StreamCall
from services.frontend.tokenization import PromptTokenizer
from services.frontend.tracing import RequestSpan, operation_name, request_attributes
from services.rpc import common_pb2, scheduler_pb2

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AdmissionPolicy:
    """What the operator decides about every request (flags of the frontend)."""

    max_inflight: int = 4096
    limits: ApiLimits = field(default_factory=ApiLimits)
    enable_client_priority: bool = False
    prefix_cache_isolation: str = "none"  # "api-key": the tenant salts the prefix cache
    tokenizer_threads: int = 1


class RequestPipeline:
    def __init__(
        self,
        tokenizer: PromptTokenizer,
        client: SchedulerRouter | SchedulerClient,
        model: ModelDescription,
        policy: AdmissionPolicy,
        metrics: RequestMetrics | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.client = client
        self.model = model
        self.policy = policy
        self.limits = policy.limits
        self.metrics = metrics
        self.telemetry = telemetry
        self.processor = OutputProcessor(tokenizer.tokenizer)
        # NOTE: scoped ids (tenant/request_id): a tenant's id never collides with, nor reveals, another tenant's.
        self.active: set[str] = set()
        self.draining = False
        self._background: set[asyncio.Task[None]] = set()
        # NOTE: tokenization and chat templates take milliseconds to seconds for long prompts: off the event loop,
        # so other streams and health checks keep flowing. Several threads are safe (`Tokenizer` never changes the
        # Rust tokenizer's settings per call, as transformers' wrapper did: "Already borrowed"); one by default.
        self._tokenize_pool = ThreadPoolExecutor(policy.tokenizer_threads, thread_name_prefix="tokenize")

    # ---- admission ----------------------------------------------------------------------------------------------
    def check_admission(self) -> None:
        if self.draining:
            self._reject(Rejection.DRAINING)
            raise RequestError(ErrorCode.UNAVAILABLE, "the frontend is shutting down: retry on another replica")
        if len(self.active) >= self.policy.max_inflight:
            self._reject(Rejection.MAX_INFLIGHT)
            raise RequestError(
                ErrorCode.RESOURCE_EXHAUSTED, f"too many requests in flight ({len(self.active)}): retry later"
            )

    def check(self, inp: GenerateInput) -> str:
        """Cheap checks before any tokenization (sizes, ranges, id); returns the request id."""
        self.check_admission()
        request_id = inp.request_id or uuid.uuid4().hex
        self.limits.check_request_id(request_id)
        self.limits.check_input(inp)
        if scoped_request_id(inp.tenant, request_id) in self.active:
            raise RequestError(ErrorCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in use", "request_id")
        return request_id

    async def encode(self, inp: PromptInput, check_length: bool = True) -> tuple[str | None, list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, inp, check_length)

    async def decode(self, ids: list[int]) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.tokenizer.decode, ids)

    async def prepare(self, inp: GenerateInput) -> PreparedRequest:
        """Validates and tokenizes; raises RequestError before anything is sent to the scheduler."""
        arrival_ns, arrival_mono = now_ns(), time.monotonic()
        request_id = self.check(inp)
        span = None
        if self.telemetry is not None:
            op = operation_name(inp.prompt.messages is not None)
            attrs = request_attributes(op, self.model.name, inp.params, inp.stream)
            span = RequestSpan(self.telemetry.tracer, f"{op} {self.model.name}", attrs)
        try:
            if span is None:
                text, ids = await self.encode(inp.prompt)
            else:
                tokenize = span.tokenize_span()
                try:
                    text, ids = await self.encode(inp.prompt)
                finally:
                    tokenize.end()
            try:
                bad_words = None
                if inp.params.bad_words:
                    loop = asyncio.get_running_loop()
                    words = inp.params.bad_words
                    bad_words = await loop.run_in_executor(self._tokenize_pool, self.tokenizer.bad_words, words)
                params = with_eos(inp.params, self.model.eos_token_id, self.model.vocab_size, bad_words)
                if params.structured_outputs is not None and self.metrics is not None:
                    self.metrics.observe_structured_output(params.structured_outputs.kind.value)
            except ValueError as e:
                raise RequestError.invalid(str(e)) from e
        except RequestError as e:
            if span is not None:
                span.finish(request_id, None, 0, e.code.value, e.message)
            raise
        return PreparedRequest(
            request_id=request_id,
            prompt_text=text,
            prompt_token_ids=ids,
            params=params,
            priority=inp.priority if self.policy.enable_client_priority else 0,
            cache_salt=self._cache_salt(inp),
            trace=inp.trace,
            arrival_ns=arrival_ns,
            arrival_monotonic=arrival_mono,
            span=span,
            tenant=inp.tenant,
            stream=inp.stream,
        )

    def _cache_salt(self, inp: GenerateInput) -> str | None:
        if self.policy.prefix_cache_isolation != "api-key":
            return inp.cache_salt
        # NOTE: the tenant always salts (so tenants never share entries); the client's salt only narrows further.
        return inp.tenant + ("/" + inp.cache_salt if inp.cache_salt else "")

    def _submit_message(self, req: PreparedRequest, trace: TraceContext) -> scheduler_pb2.SubmitRequest:
        return scheduler_pb2.SubmitRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            # NOTE: stop strings stay here: the frontend matches them; the scheduler and workers see token ids only.
            sampling=params_to_proto(req.params, with_stop_strings=False),
            priority=req.priority,
            cache_salt=req.cache_salt or "",
            trace=trace.to_proto(),
            timestamps=common_pb2.RequestTimestamps(arrival_ns=req.arrival_ns),
            owner=req.tenant,
        )

    # ---- streaming ----------------------------------------------------------------------------------------------
    async def stream(self, req: PreparedRequest) -> AsyncIterator[StreamEvent]:
        """Streams one request. Closing the iterator early (client gone) cancels it on the scheduler stream, which
        aborts the request there."""
        rid = req.request_id
        key = scoped_request_id(req.tenant, rid)  # the output processor's and the scheduler's id
        if key in self.active:
            err = RequestError(ErrorCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use", "request_id")
            if req.span is not None:
                req.span.finish(rid, None, len(req.prompt_token_ids), err.code.value, err.message)
            raise err
        self.active.add(key)
        call: RoutedCall | StreamCall | None = None
        output: RequestOutput | None = None
        span = req.span
        done = False
        first = True
        first_token_ns = scheduled_ns = last_token_ns = 0
        timestamps = common_pb2.RequestTimestamps()
        plp_sent = 0
        error = ""
        error_type: str | None = None
        # NOTE: everything after taking the slot is inside the try: every failure path releases it.
        try:
            self.processor.add_request(
                key,
                req.prompt_text,
                req.prompt_token_ids,
                req.params,
                req.arrival_monotonic,
                keep_logprobs=not req.stream,
            )
            output = self.processor.requests[key].output
            if span is None:
                # NOTE: tracing off: the client's context travels on unchanged.
                call = self.client.submit(self._submit_message(req, req.trace))
            else:
                # NOTE: the scheduler's parent is this request's call span (the child of the frontend's request
                # span), never the client's header unchanged.
                call = self.client.submit(self._submit_message(req, TraceContext.of_span(span.call_span())))
            async for msg in call:
                t0 = span.detokenize_begin() if span is not None else 0.0
                step = self.processor.process([seq_output_from_proto(key, o) for o in msg.outputs])
                if span is not None:
                    span.detokenize_end(t0)
                for stop in step.stops:
                    self._finish_choice(stop, req)
                if msg.HasField("timestamps"):  # NOTE: sent only when a time changed (scheduler.proto)
                    timestamps = msg.timestamps
                    scheduled_ns = timestamps.scheduled_ns or scheduled_ns
                error = msg.error or error
                deltas = [d for u in step.updates for d in u.deltas]
                if any(d.token_ids for d in deltas):
                    now = now_ns()
                    if not first_token_ns:
                        first_token_ns = now
                    elif self.metrics is not None:
                        self.metrics.observe_tokens((now - last_token_ns) / 1e9)
                    last_token_ns = now
                if msg.finished and not output.finished:
                    # NOTE: cannot happen with a healthy scheduler (it reports every choice's end); never hang.
                    self.processor.abort(key)
                event = StreamEvent(rid, deltas, first=first)
                first = False
                plp = output.prompt_logprobs
                if (
                    plp is not None
                    and len(plp) > plp_sent
                    and (len(plp) >= len(req.prompt_token_ids) or output.finished)
                ):
                    event.prompt_logprobs, event.prompt_logprobs_start = list(plp[plp_sent:]), plp_sent
                    plp_sent = len(plp)
                if output.finished:
                    done = True
                    event.final = self._final(req, output, scheduled_ns, first_token_ns, error)
                    self._record_end(req, event.final, timestamps)
                if event.deltas or event.final is not None or event.prompt_logprobs or event.first:
                    yield event
                if done:
                    break
            if not done:
                raise RequestError(ErrorCode.INTERNAL, "the scheduler ended the stream before the request finished")
        except grpc.aio.AioRpcError as e:
            err = rpc_error(e)
            error_type = err.code.value
            if first:  # NOTE: before the scheduler's first message (its "admitted"): refused at admission
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._reject(Rejection.SCHEDULER_FULL)
                elif e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._reject(Rejection.SCHEDULER_UNAVAILABLE)
            raise err from e
        except RequestError as e:
            error_type = e.code.value
            raise
        finally:
            self.active.discard(key)
            if not done and key in self.processor.requests:
                self.processor.abort(key)
                error_type = error_type or "cancelled"
                # NOTE: the one `request finished` line of a request that ended without its final message.
                log.info("request finished", error=error_type, **request_fields(rid, self._trace_of(req)))
            if span is not None:
                span.finish(rid, output, len(req.prompt_token_ids), error_type, error)
            # NOTE: a no-op after a normal end; otherwise (client gone, stop strings ended every choice) the
            # cancellation reaches the scheduler as an abort.
            if call is not None:
                call.cancel()

    def _reject(self, rejection: Rejection) -> None:
        if self.metrics is not None:
            self.metrics.observe_rejection(rejection)

    def _finish_choice(self, stop: StopMatch, req: PreparedRequest) -> None:
        async def send() -> None:
            try:
                trace = req.trace.to_proto()
                await self.client.finish_choice(req.request_id, req.tenant, stop.index, stop.stop, trace)
            except grpc.aio.AioRpcError as e:
                log.warning("FinishChoice failed", request_id=req.request_id, error=e.details())

        task = asyncio.ensure_future(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def _trace_of(req: PreparedRequest) -> TraceContext:
        return req.trace if req.span is None else TraceContext.of_span(req.span.span)

    def _record_end(self, req: PreparedRequest, final: FinalInfo, ts: common_pb2.RequestTimestamps) -> None:
        """The request's metrics and its one `request finished` log line (no prompt text: never at info)."""
        reasons = [c.finish_reason or "" for c in final.output.outputs]
        u, t = final.usage, final.timings
        ttft = t.ttft_s if u.completion_tokens else None
        if self.metrics is not None:
            self.metrics.observe_end(reasons, u.prompt_tokens, u.completion_tokens, ttft, t.e2e_s, ts)
        log.info(
            "request finished",
            **request_fields(req.request_id, self._trace_of(req)),
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens,
            finish_reasons=reasons,
            ttft_s=round(t.ttft_s, 4),
            e2e_s=round(t.e2e_s, 4),
            error=final.error or None,
            **spec_decode_fields(final.output),
        )

    @staticmethod
    def _final(
        req: PreparedRequest, output: RequestOutput, scheduled_ns: int, first_token_ns: int, error: str
    ) -> FinalInfo:
        end = now_ns()

        def since_arrival(t: int) -> float:
            return max(0.0, (t - req.arrival_ns) / 1e9) if t else 0.0

        usage = Usage(
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=sum(len(c.token_ids) for c in output.outputs),
            cached_tokens=output.num_cached_tokens,
        )
        timings = Timings(since_arrival(scheduled_ns), since_arrival(first_token_ns), since_arrival(end))
        return FinalInfo(output, usage, timings, error)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[StreamEvent]:
        async for event in self.stream(await self.prepare(inp)):
            yield event

    async def abort(self, request_id: str, tenant: str) -> bool:
        """Aborts a request of any frontend, if `tenant` submitted it (the scheduler ends its stream with ABORT);
        another tenant's request answers found=False, as if it did not exist."""
        try:
            return await self.client.abort(request_id, tenant)
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e) from e


def spec_decode_fields(output: RequestOutput) -> dict[str, int | float]:
    """The `request finished` line's speculative-decoding fields; none when the request verified no drafts."""
    if not output.num_draft_tokens:
        return {}
    return {
        "spec_draft_tokens": output.num_draft_tokens,
        "spec_accepted_tokens": output.num_accepted_tokens,
        "spec_acceptance": round(output.num_accepted_tokens / output.num_draft_tokens, 3),
    }
