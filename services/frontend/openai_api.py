"""The OpenAI-compatible HTTP API (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, SSE streaming).

It runs in the frontend process, on the same event loop as the gRPC server, and uses the same request path.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.trace import TraceContext
from services.frontend.auth import ApiKeys
from services.frontend.body_limit import BodySizeLimit
from services.frontend.openai_convert import (
    CompletionLogprobsBuilder,
    chat_input,
    chat_logprobs,
    completion_inputs,
    finish_fields,
    usage_info,
)
from services.frontend.openai_errors import error_body, error_response, http_error_body, validation_error
from services.frontend.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from services.frontend.pipeline import RequestPipeline
from services.frontend.request import ErrorCode, FinalInfo, PreparedRequest, RequestError, Usage
from services.frontend.response_extras import (
    continuous_usage,
    echo_logprobs,
    joined,
    prompt_logprobs_body,
    running_usage,
)
from services.frontend.slow_clients import DEFAULT_STREAM_SEND_TIMEOUT
from services.frontend.sse_streams import merge_streams, sse_data, start_sse
from services.frontend.tokenize_api import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    detokenize,
    tokenize,
)
from services.frontend.tool_calls import ChoiceTools, ToolPlan, ToolSettings, delta_calls, plan_tools, whole_message


class OpenAIRoutes:
    def __init__(
        self,
        pipeline: RequestPipeline,
        is_serving: Callable[[], bool],
        keys: ApiKeys,
        send_timeout: float,
        tools: ToolSettings,
    ) -> None:
        self.pipeline = pipeline
        self.is_serving = is_serving
        self.keys = keys
        self.send_timeout = send_timeout
        self.tools = tools

    def _tenant(self, request: Request) -> str:
        return self.keys.tenant(request.headers.items())

    def _trace(self, request: Request) -> TraceContext:
        trace = TraceContext.from_metadata(request.headers.items())
        return TraceContext(trace.traceparent, self.pipeline.limits.tracestate(trace.tracestate))

    async def _collect_all(self, request: Request, prepared: list[PreparedRequest]) -> list[FinalInfo] | None:
        """Every prompt's result; None when the client disconnected. One prompt failing, or the client going
        away, cancels (aborts) all of them: nobody would read the rest."""
        tasks = [asyncio.ensure_future(self._collect(p)) for p in prepared]
        gathered = asyncio.gather(*tasks)
        try:
            while True:
                done, _ = await asyncio.wait([gathered], timeout=0.25)
                if done:
                    return gathered.result()
                if await request.is_disconnected():
                    return None
        finally:
            for task in tasks:
                task.cancel()
            if not gathered.done():
                gathered.cancel()
            # NOTE: collect the cancelled/failed siblings so none logs "exception was never retrieved".
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def model_name(self) -> str:
        return self.pipeline.model.name

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                ErrorCode.NOT_FOUND, f"model {model!r} does not exist (serving {self.model_name!r})", "model"
            )

    async def health(self) -> Response:
        return Response(status_code=200 if self.is_serving() else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except RequestError as e:
            return error_response(e)
        return JSONResponse(self._model_list().model_dump())

    def _model_list(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.pipeline.model.max_model_len)])

    # ---- /tokenize, /detokenize (vLLM's) ----------------------------------------------------------------------------
    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> Response:
        try:
            self._tenant(request)
            self._check_model(body.model)
            return JSONResponse((await tokenize(self.pipeline, body)).model_dump())
        except RequestError as e:
            return error_response(e)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        try:
            self._tenant(request)
            self._check_model(body.model)
            return JSONResponse((await detokenize(self.pipeline, body)).model_dump())
        except RequestError as e:
            return error_response(e)

    # ---- /v1/completions -----------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
            self._check_model(body.model)
            rid = body.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
            inputs = completion_inputs(body, self._trace(request), rid, tenant, self.pipeline.limits.max_prompts)
            for inp in inputs:  # NOTE: every prompt's cheap checks before tokenizing any of them
                self.pipeline.check(inp)
            prepared = [await self.pipeline.prepare(i) for i in inputs]
        except RequestError as e:
            return error_response(e)
        if body.stream:
            return await start_sse(self._completion_stream(body, f"cmpl-{rid}", prepared), self.send_timeout, rid)
        try:
            finals = await self._collect_all(request, prepared)
        except RequestError as e:
            return error_response(e)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choices = []
        for i, (p, final) in enumerate(zip(prepared, finals, strict=True)):
            plp = final.output.prompt_logprobs
            for c in final.output.outputs:
                lp = None
                if body.logprobs is not None and c.logprobs is not None:
                    builder = CompletionLogprobsBuilder()
                    if body.echo and plp is not None:
                        first = self.pipeline.tokenizer.tokenizer.decode(p.prompt_token_ids[:1])
                        lp = joined(echo_logprobs(builder, first, plp), builder.build(c.logprobs))
                    else:
                        lp = builder.build(c.logprobs)
                prefix = self._prompt_text(p) if body.echo else ""
                choices.append(
                    CompletionChoice(
                        index=i * body.n + c.index,
                        text=prefix + c.text,
                        logprobs=lp,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=prompt_logprobs_body(plp) if body.prompt_logprobs is not None else None,
                        prompt_token_ids=p.prompt_token_ids if body.return_token_ids else None,
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                    )
                )
        usage = usage_info([f.usage for f in finals])
        return JSONResponse(
            CompletionResponse(id=f"cmpl-{rid}", model=self.model_name, choices=choices, usage=usage).model_dump()
        )

    def _prompt_text(self, p: PreparedRequest) -> str:
        return (
            p.prompt_text if p.prompt_text is not None else self.pipeline.tokenizer.tokenizer.decode(p.prompt_token_ids)
        )

    async def _collect(self, prepared: PreparedRequest) -> FinalInfo:
        async for event in self.pipeline.stream(prepared):
            if event.final is not None:
                if event.final.error:
                    raise RequestError(ErrorCode.INTERNAL, event.final.error)
                return event.final
        raise RequestError(ErrorCode.INTERNAL, "the stream ended without a result")

    async def _completion_stream(
        self, body: CompletionRequest, cid: str, prepared: list[PreparedRequest]
    ) -> AsyncIterator[str]:
        n = body.n
        builders: dict[int, CompletionLogprobsBuilder] = {}
        usages: list[Usage] = []
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        running = continuous_usage(body.stream_options)
        generated = [0] * len(prepared)
        started = False
        try:
            async for i, event in merge_streams([self.pipeline.stream(p) for p in prepared]):
                if not started:
                    started = True
                    yield ""  # admitted: _start_sse answers 200 now
                choices = []
                if event.first and (body.echo or body.return_token_ids):
                    text = self._prompt_text(prepared[i]) if body.echo else ""
                    ids = prepared[i].prompt_token_ids if body.return_token_ids else None
                    choices += [CompletionChoice(index=i * n + j, text=text, prompt_token_ids=ids) for j in range(n)]
                for d in event.deltas:
                    generated[i] += len(d.token_ids)
                    index = i * n + d.index
                    lp = None
                    if body.logprobs is not None and d.logprobs is not None:
                        lp = builders.setdefault(index, CompletionLogprobsBuilder()).build(list(d.logprobs))
                    reason, stop = finish_fields(d)
                    ids = list(d.token_ids) if body.return_token_ids else None
                    choices.append(
                        CompletionChoice(
                            index=index, text=d.text, logprobs=lp, finish_reason=reason, stop_reason=stop, token_ids=ids
                        )
                    )
                if event.final is not None:
                    usages.append(event.final.usage)
                    if event.final.error:
                        raise RequestError(ErrorCode.INTERNAL, event.final.error)
                if choices:
                    usage = running_usage(len(prepared[i].prompt_token_ids), generated[i]) if running else None
                    yield sse_data(CompletionResponse(id=cid, model=self.model_name, choices=choices, usage=usage))
            if include_usage:
                yield sse_data(CompletionResponse(id=cid, model=self.model_name, choices=[], usage=usage_info(usages)))
            yield "data: [DONE]\n\n"
        except RequestError as e:
            if not started:
                raise
            yield sse_data(error_body(e))

    # ---- /v1/chat/completions ------------------------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
            self._check_model(body.model)
            rid = body.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex
            plan = plan_tools(body, self.tools, self.pipeline.limits)
            prepared = await self.pipeline.prepare(chat_input(body, self._trace(request), rid, tenant, plan))
        except RequestError as e:
            return error_response(e)
        cid = f"chatcmpl-{rid}"
        top_k = body.top_logprobs or 0
        if body.stream:
            return await start_sse(self._chat_stream(body, cid, prepared, top_k, plan), self.send_timeout, rid)
        try:
            finals = await self._collect_all(request, [prepared])
        except RequestError as e:
            return error_response(e)
        if finals is None:
            return Response(status_code=499)
        final = finals[0]
        choices = []
        for c in final.output.outputs:
            content, calls, reason = c.text, None, c.finish_reason
            if plan.new_parser is not None:
                content, calls, reason = whole_message(plan, c.text, c.finish_reason)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatMessageOut(content=content, tool_calls=calls),
                    logprobs=chat_logprobs(c.logprobs, top_k) if body.logprobs and c.logprobs is not None else None,
                    finish_reason=reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                )
            )
        resp = ChatCompletionResponse(
            id=cid,
            model=self.model_name,
            choices=choices,
            usage=usage_info([final.usage]),
            prompt_logprobs=prompt_logprobs_body(final.output.prompt_logprobs)
            if body.prompt_logprobs is not None
            else None,
            prompt_token_ids=prepared.prompt_token_ids if body.return_token_ids else None,
        )
        return JSONResponse(resp.model_dump())

    async def _chat_stream(
        self, body: ChatCompletionRequest, cid: str, prepared: PreparedRequest, top_k: int, plan: ToolPlan
    ) -> AsyncIterator[str]:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        usage: Usage | None = None
        tools: dict[int, ChoiceTools] = {}
        running = continuous_usage(body.stream_options)
        prompt_tokens, generated = len(prepared.prompt_token_ids), 0
        started = False
        try:
            async for event in self.pipeline.stream(prepared):
                started = True
                if event.first:
                    role = ChatDelta(role="assistant", content="")
                    first = [ChatChunkChoice(index=j, delta=role) for j in range(body.n)]
                    ids = prepared.prompt_token_ids if body.return_token_ids else None
                    yield sse_data(
                        ChatCompletionChunk(id=cid, model=self.model_name, choices=first, prompt_token_ids=ids)
                    )
                choices = []
                for d in event.deltas:
                    generated += len(d.token_ids)
                    lp = chat_logprobs(list(d.logprobs), top_k) if body.logprobs and d.logprobs is not None else None
                    reason, stop = finish_fields(d)
                    delta = ChatDelta(content=d.text)
                    if plan.new_parser is not None:
                        choice_tools = tools.setdefault(d.index, ChoiceTools(plan))
                        piece = choice_tools.feed(d.text, finished=reason is not None)
                        calls = delta_calls(piece)
                        # NOTE: as OpenAI: a chunk carrying tool calls and no text has content null.
                        content = piece.content if piece.content or not calls else None
                        delta = ChatDelta(content=content, tool_calls=calls)
                        reason = choice_tools.finish_reason(reason)
                    choices.append(
                        ChatChunkChoice(
                            index=d.index,
                            delta=delta,
                            logprobs=lp,
                            finish_reason=reason,
                            stop_reason=stop,
                            token_ids=list(d.token_ids) if body.return_token_ids else None,
                        )
                    )
                if event.final is not None:
                    usage = event.final.usage
                    if event.final.error:
                        raise RequestError(ErrorCode.INTERNAL, event.final.error)
                if choices:
                    now = running_usage(prompt_tokens, generated) if running else None
                    yield sse_data(ChatCompletionChunk(id=cid, model=self.model_name, choices=choices, usage=now))
            if include_usage and usage is not None:
                yield sse_data(
                    ChatCompletionChunk(id=cid, model=self.model_name, choices=[], usage=usage_info([usage]))
                )
            yield "data: [DONE]\n\n"
        except RequestError as e:
            if not started:
                raise
            yield sse_data(error_body(e))


def create_app(
    pipeline: RequestPipeline,
    is_serving: Callable[[], bool],
    keys: ApiKeys | None = None,
    send_timeout: float = DEFAULT_STREAM_SEND_TIMEOUT,
    tools: ToolSettings | None = None,
) -> FastAPI:
    app = FastAPI(
        title="Pagoda", description="OpenAI-compatible API of the Pagoda frontend", docs_url=None, redoc_url=None
    )
    app.add_middleware(BodySizeLimit, max_bytes=pipeline.limits.max_request_bytes)
    routes = OpenAIRoutes(pipeline, is_serving, keys or ApiKeys([]), send_timeout, tools or ToolSettings())
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"], response_model=None)
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"], response_model=None)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"], response_model=None)

    async def on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        body = http_error_body(exc.status_code, str(exc.detail))
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    return app
