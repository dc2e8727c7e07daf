"""The scheduler's Submit stream (protos/scheduler.proto SubmitResponse): what its messages carry. A token's message
carries its outputs alone; the request's timestamps come only on the messages where one of them changed, and the
trace context on the first and the final message, so a frontend reading 64 streams does not parse them per token."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.launcher import LocalCluster
from services.rpc import common_pb2, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 260, 1345, 28, 216]
MAX_TOKENS = 16
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def scheduler(cluster: LocalCluster) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with grpc.insecure_channel(cluster.scheduler_addr) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def test_timestamps_only_when_they_change(scheduler: scheduler_pb2_grpc.SchedulerStub) -> None:
    request = scheduler_pb2.SubmitRequest(
        request_id="stream-messages",
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
        trace=common_pb2.TraceContext(traceparent=TRACEPARENT),
        timestamps=common_pb2.RequestTimestamps(arrival_ns=1),
    )
    messages = list(scheduler.Submit(request, timeout=120))
    admitted, rest, final = messages[0], messages[1:], messages[-1]
    assert not admitted.outputs and admitted.HasField("timestamps") and admitted.timestamps.queued_ns
    assert admitted.trace.traceparent == TRACEPARENT
    assert sum(len(o.new_token_ids) for m in rest for o in m.outputs) == MAX_TOKENS
    assert len(rest) >= 4  # one message per step: enough to tell "every message" from "when a time changed"
    # Times change at most three times after admission (scheduled, first token, finished): the other token
    # messages carry neither the timestamps nor the trace.
    with_times = [m for m in rest if m.HasField("timestamps")]
    assert 1 <= len(with_times) <= 3 < len(rest)
    assert all(not m.HasField("trace") for m in rest[:-1])
    assert final.finished and final.trace.traceparent == TRACEPARENT
    ts = final.timestamps
    assert ts.arrival_ns == 1 and ts.queued_ns == admitted.timestamps.queued_ns  # the frontend's, passed on
    assert 0 < ts.scheduled_ns <= ts.first_token_ns <= ts.finished_ns
