"""The frontend's connection to the scheduler: one HTTP/2 channel, and on it one `Stream` call for all requests."""

from __future__ import annotations

import grpc

from services.common.grpc_opts import CHANNEL_OPTIONS
from services.common.health import wait_serving_async
from services.common.tls import TlsFiles, aio_channel
from services.frontend.request import ErrorCode, RequestError
from services.frontend.scheduler_stream import SchedulerStream, StreamCall
from services.rpc import SCHEDULER_SERVICE, common_pb2, scheduler_pb2, scheduler_pb2_grpc

# gRPC status -> the frontend's error codes (the scheduler's message is passed on unchanged).
_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED: ErrorCode.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED: ErrorCode.UNAUTHENTICATED,
}


def rpc_error(e: grpc.aio.AioRpcError) -> RequestError:
    code = _CODES.get(e.code(), ErrorCode.INTERNAL)
    details = e.details() or e.code().name
    if code is ErrorCode.UNAVAILABLE and not details.startswith("worker"):
        details = f"scheduler unavailable: {details}"
    return RequestError(code, details, details.split(" ", 1)[0] if code is ErrorCode.INVALID_ARGUMENT else None)


class SchedulerClient:
    def __init__(
        self,
        addr: str,
        tls: TlsFiles | None = None,
        interceptors: list[grpc.aio.ClientInterceptor] | None = None,
        tls_name: str | None = None,
    ) -> None:
        self.addr = addr
        options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
        if tls_name:
            # NOTE: a pod's IP from the headless Service's DNS: its certificate names the Service, not the IP.
            options.append(("grpc.ssl_target_name_override", tls_name))
        self.channel = aio_channel(addr, tls or TlsFiles(), options, interceptors)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.stream = SchedulerStream(self.stub)

    async def wait_ready(self, timeout: float) -> scheduler_pb2.InfoResponse:
        await wait_serving_async(self.channel, SCHEDULER_SERVICE, timeout=timeout)
        return await self.stub.Info(scheduler_pb2.InfoRequest(), timeout=10.0)

    def submit(self, request: scheduler_pb2.SubmitRequest) -> StreamCall:
        """Sends the request on the shared `Stream` call (opened now if none is open); never blocks."""
        return self.stream.submit(request)

    async def abort(self, request_id: str, owner: str) -> bool:
        resp = await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id, owner=owner), timeout=10.0)
        return resp.found

    async def finish_choice(
        self, request_id: str, owner: str, index: int, stop: str, trace: common_pb2.TraceContext
    ) -> None:
        req = scheduler_pb2.FinishChoiceRequest(request_id=request_id, index=index, stop=stop, trace=trace, owner=owner)
        await self.stub.FinishChoice(req, timeout=10.0)

    async def stats(self) -> scheduler_pb2.StatsResponse:
        return await self.stub.Stats(scheduler_pb2.StatsRequest(), timeout=10.0)

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()
