"""The control processes' per-message costs at 64 streams, each against what it replaced (docs/benchmarks.md
"Serving at 64 streams against offline"): a token's Submit message (built, serialized, parsed) with and without the
trace context and timestamps, a step's 64 token messages as 64 `Submit` messages against one `Stream` message, a send
under --stream-send-timeout (asyncio.timeout per message against SendWatchdog's bookkeeping), and the KV-event
watch's wait (asyncio.wait_for against asyncio.timeout_at). CPU time per operation, best of 3 rounds, both arms in
each round. (The gRPC writes, reads and event-loop wake-ups the `Stream` message saves are not in these numbers:
benchmarks/served_steps.py measures them, as the processes' CPU per load.)

    PYTHONPATH=$PWD .venv/bin/python benchmarks/control_costs.py
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from engine_core.core.request import Request
from engine_core.core.seq_output import SeqOutput
from engine_core.sampling_params import SamplingParams
from services.common.timeutil import monotonic_to_ns
from services.convert.outputs import seq_output_to_proto
from services.frontend.slow_clients import SendWatchdog
from services.rpc import common_pb2, scheduler_pb2
from services.scheduler.request_events import RequestEvent
from services.scheduler.request_streams import RequestStream, StreamConnection, fill_response

N = 20_000
OUT = SeqOutput(request_id="r", index=0, new_token_ids=[1234])
STAMPS = common_pb2.RequestTimestamps(arrival_ns=1_795_726_213_000_000_000, queued_ns=1_795_726_213_000_000_001)
TRACE = common_pb2.TraceContext(traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
T0 = time.monotonic()
LOOP = asyncio.new_event_loop()  # NOTE: StreamConnection schedules its flush here; the loop never runs


def every_field() -> scheduler_pb2.SubmitResponse:
    """The message as it was: the timestamps copied and converted, the trace context on every token."""
    ts = common_pb2.RequestTimestamps()
    ts.CopyFrom(STAMPS)
    ts.scheduled_ns, ts.first_token_ns, ts.finished_ns = monotonic_to_ns(T0), monotonic_to_ns(T0), 0
    return scheduler_pb2.SubmitResponse(outputs=[seq_output_to_proto(OUT)], trace=TRACE, timestamps=ts)


STREAM = RequestStream(Request("r", [1], SamplingParams()), STAMPS, TRACE, owner="", span=None)
EVENT = RequestEvent("r", outputs=[OUT], times=(T0, T0, None))
STREAM.sent_times = EVENT.times  # an earlier message carried these times


def outputs_only() -> scheduler_pb2.SubmitResponse:
    """The message as the scheduler builds it now (`fill_response`): a token whose times did not change."""
    msg = scheduler_pb2.SubmitResponse()
    fill_response(msg, STREAM, EVENT)
    return msg


STEP_REQUESTS = 64


def per_request_messages() -> list[bytes]:
    """One step at 64 streams on `Submit`: 64 messages, each built and serialized."""
    return [outputs_only().SerializeToString() for _ in range(STEP_REQUESTS)]


def one_stream_message() -> bytes:
    """The same step on `Stream`: the 64 requests' messages gathered (`StreamConnection.add`) into one."""
    conn = StreamConnection(LOOP)
    for tag in range(1, STEP_REQUESTS + 1):
        fill_response(conn.add(tag), STREAM, EVENT)
    response = conn._pending
    assert response is not None
    return response.SerializeToString()


def per_op_us(f: Callable[[], object], n: int = N) -> float:
    t = time.process_time()
    for _ in range(n):
        f()
    return (time.process_time() - t) / n * 1e6


async def per_op_us_async(f: Callable[[], Awaitable[None]], n: int = N) -> float:
    t = time.process_time()
    for _ in range(n):
        await f()
    return (time.process_time() - t) / n * 1e6


async def sends_and_waits() -> None:
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    async def send() -> None:  # a send that completes at once, as uvicorn's does while its buffer has room
        return None

    async def timeout_per_send() -> None:
        async with asyncio.timeout(30):
            await send()

    async def wait_for() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=0)

    async def timeout_at() -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(loop.time()):
                await event.wait()

    async with SendWatchdog(30, "r") as watchdog:

        async def watchdog_send() -> None:
            await watchdog.send(send())

        pairs = [
            ("send under --stream-send-timeout", timeout_per_send, watchdog_send, N),
            ("KV-event watch wait", wait_for, timeout_at, 2_000),
        ]
        for name, old, new, n in pairs:
            rounds = [(await per_op_us_async(old, n), await per_op_us_async(new, n)) for _ in range(3)]
            print(f"{name}: {min(r[0] for r in rounds):.2f} -> {min(r[1] for r in rounds):.2f} us")


def main() -> None:
    old_bytes, new_bytes = every_field().SerializeToString(), outputs_only().SerializeToString()
    rounds = [
        (per_op_us(lambda: every_field().SerializeToString()), per_op_us(lambda: outputs_only().SerializeToString()))
        for _ in range(3)
    ]
    print(f"token message, build + serialize: {min(r[0] for r in rounds):.2f} -> {min(r[1] for r in rounds):.2f} us")
    rounds = [
        (
            per_op_us(lambda: scheduler_pb2.SubmitResponse.FromString(old_bytes)),
            per_op_us(lambda: scheduler_pb2.SubmitResponse.FromString(new_bytes)),
        )
        for _ in range(3)
    ]
    print(
        f"token message, parse: {min(r[0] for r in rounds):.2f} -> {min(r[1] for r in rounds):.2f} us"
        f" ({len(old_bytes)} -> {len(new_bytes)} bytes)"
    )
    per_step = [per_request_messages(), [one_stream_message()]]
    rounds = [(per_op_us(per_request_messages, N // 64), per_op_us(one_stream_message, N // 64)) for _ in range(3)]
    print(
        f"a step's {STEP_REQUESTS} token messages, build + serialize: {min(r[0] for r in rounds):.1f} (Submit, "
        f"{len(per_step[0])} messages) -> {min(r[1] for r in rounds):.1f} us (Stream, 1 message)"
    )
    rounds = [
        (
            per_op_us(lambda: [scheduler_pb2.SubmitResponse.FromString(b) for b in per_step[0]], N // 64),
            per_op_us(lambda: scheduler_pb2.StreamResponse.FromString(per_step[1][0]).responses, N // 64),
        )
        for _ in range(3)
    ]
    print(
        f"a step's {STEP_REQUESTS} token messages, parse: {min(r[0] for r in rounds):.1f} -> "
        f"{min(r[1] for r in rounds):.1f} us ({sum(map(len, per_step[0]))} -> {len(per_step[1][0])} bytes)"
    )
    asyncio.run(sends_and_waits())


if __name__ == "__main__":
    main()
