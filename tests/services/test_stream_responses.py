"""How the scheduler gathers a `Stream` call's messages (services/scheduler/request_streams.py): every request's
message of one event-loop iteration in one `StreamResponse`, large ones built in place and the response cut at its
byte bound."""

from __future__ import annotations

import asyncio

from engine_core.core.request import Request
from engine_core.core.seq_output import SeqOutput, TokenLogprobs
from engine_core.sampling_params import SamplingParams
from services.rpc import common_pb2, scheduler_pb2
from services.scheduler.request_events import RequestEvent
from services.scheduler.request_streams import STREAM_RESPONSE_BYTES, RequestStream, StreamConnection, fill_response

TOP_K = 200  # NOTE: wide rows make a MiB of message from few positions (fast to build)


def _request_stream(conn: StreamConnection | None, tag: int) -> RequestStream:
    request = Request(f"r{tag}", [1, 2, 3], SamplingParams(max_tokens=4096))
    stream = RequestStream(request, common_pb2.RequestTimestamps(), common_pb2.TraceContext(), "", None, conn, tag)
    if conn is not None:
        conn.requests[tag] = stream
    return stream


def _event(tag: int, tokens: int, logprobs: bool) -> RequestEvent:
    lps = [TokenLogprobs([tag + i] * (TOP_K + 1), [-0.5 - i] * (TOP_K + 1), 1) for i in range(tokens)]
    out = SeqOutput(f"r{tag}", 0, [tag + i for i in range(tokens)], new_logprobs=lps if logprobs else None)
    return RequestEvent(f"r{tag}", outputs=[out], times=(None, None, None))


def _gather(events: dict[int, RequestEvent]) -> list[scheduler_pb2.StreamResponse]:
    """One iteration's dispatch of `events` (tag -> event) on a fresh connection: the responses it sent."""

    async def run() -> list[scheduler_pb2.StreamResponse]:
        conn = StreamConnection(asyncio.get_running_loop())
        streams = {tag: _request_stream(conn, tag) for tag in events}
        for tag, event in events.items():
            assert streams[tag].send(event)
        await asyncio.sleep(0)  # the flush runs after the dispatch's callback
        out = []
        while not conn.outbox.empty():
            response = conn.outbox.get_nowait()
            assert response is not None
            out.append(response)
        return out

    # NOTE: not asyncio.run, which formats the finished task, its result (these messages) included, as text
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def _expected(tag: int, event: RequestEvent) -> scheduler_pb2.SubmitResponse:
    """The message built on its own, as `Submit` builds it."""
    alone = _request_stream(None, tag)
    msg = scheduler_pb2.SubmitResponse()
    fill_response(msg, alone, event)
    msg.tag = tag
    return msg


def test_small_messages_of_an_iteration_leave_as_one_response() -> None:
    events = {tag: _event(tag, 1, logprobs=False) for tag in range(1, 65)}
    (response,) = _gather(events)
    assert [m.tag for m in response.responses] == list(events)
    for msg in response.responses:
        assert msg == _expected(msg.tag, events[msg.tag])


def test_large_messages_are_built_in_place_and_cut_at_the_byte_bound() -> None:
    # Each ~1 MiB (1,024 tokens with 200 logprobs each): three or four fit a response.
    events = {tag: _event(tag, 1024, logprobs=True) for tag in range(1, 12)}
    size = _expected(1, events[1]).ByteSize()
    assert STREAM_RESPONSE_BYTES // 5 < size < STREAM_RESPONSE_BYTES // 3
    events[6] = _event(6, 1, logprobs=False)  # a small one among them stays in its place
    responses = _gather(events)
    assert len(responses) > 1
    for response in responses:
        assert response.ByteSize() <= STREAM_RESPONSE_BYTES + 64 * len(response.responses)
    # every message exactly once, in the order sent, each as built on its own
    msgs = [m for r in responses for m in r.responses]
    assert [m.tag for m in msgs] == list(events)
    for msg in msgs:
        assert msg == _expected(msg.tag, events[msg.tag])


def test_one_message_over_the_bound_leaves_alone() -> None:
    events = {1: _event(1, 8, logprobs=False), 2: _event(2, 5000, logprobs=True), 3: _event(3, 8, logprobs=False)}
    responses = _gather(events)
    assert [[m.tag for m in r.responses] for r in responses] == [[1], [2], [3]]
    assert responses[1].responses[0] == _expected(2, events[2])
