"""The scheduler's `Stream` call (protos/scheduler.proto), which carries all of a frontend's requests: what one
message carries, per-request refusals, and cancellation by tag or by the call's end, against the real scheduler."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from services.launcher import LocalCluster
from services.rpc import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.services.conftest import stats

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 260, 1345, 28, 216]


def _submit(tag: int, max_tokens: int, prompt: list[int] | None = None) -> scheduler_pb2.StreamRequest:
    return scheduler_pb2.StreamRequest(
        submit=scheduler_pb2.SubmitRequest(
            request_id=f"stream-test-{tag}-{time.monotonic_ns()}",
            prompt_token_ids=PROMPT if prompt is None else prompt,
            sampling=common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            tag=tag,
        )
    )


class OpenStream:
    """One `Stream` call, its requests written from a queue and its responses read on a thread."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        self._requests: queue.Queue[scheduler_pb2.StreamRequest | None] = queue.Queue()
        self.call = stub.Stream(iter(self._requests.get, None), timeout=300)
        self.responses: queue.Queue[scheduler_pb2.StreamResponse | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.responses.put(response)
        except grpc.RpcError:
            pass
        self.responses.put(None)

    def send(self, request: scheduler_pb2.StreamRequest) -> None:
        self._requests.put(request)

    def read_until_finished(self, tags: set[int]) -> list[scheduler_pb2.StreamResponse]:
        """Every response until each of `tags` got its finished message."""
        out, open_tags = [], set(tags)
        while open_tags:
            response = self.responses.get(timeout=120)
            assert response is not None, "the call ended early"
            out.append(response)
            open_tags -= {m.tag for m in response.responses if m.finished}
        return out

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


@pytest.fixture
def scheduler(cluster: LocalCluster) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with grpc.insecure_channel(cluster.scheduler_addr) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def _by_tag(responses: list[scheduler_pb2.StreamResponse]) -> dict[int, list[scheduler_pb2.SubmitResponse]]:
    out: dict[int, list[scheduler_pb2.SubmitResponse]] = {}
    for response in responses:
        for msg in response.responses:
            out.setdefault(msg.tag, []).append(msg)
    return out


def _tokens(messages: list[scheduler_pb2.SubmitResponse]) -> list[int]:
    return [t for m in messages for o in m.outputs for t in o.new_token_ids]


def test_one_message_carries_a_step_of_every_request(scheduler: scheduler_pb2_grpc.SchedulerStub) -> None:
    alone = [
        t for m in scheduler.Submit(_submit(0, 12).submit, timeout=120) for o in m.outputs for t in o.new_token_ids
    ]
    stream = OpenStream(scheduler)
    try:
        stream.send(_submit(1, 12))
        stream.send(_submit(2, 12, PROMPT[:5]))
        responses = stream.read_until_finished({1, 2})
    finally:
        stream.close()
    per_tag = _by_tag(responses)
    assert set(per_tag) == {1, 2}
    for messages in per_tag.values():
        admitted = messages[0]
        assert not admitted.outputs and admitted.timestamps.queued_ns and not admitted.finished
        assert messages[-1].finished and not messages[-1].error_code
        assert sum(m.finished for m in messages) == 1
    assert _tokens(per_tag[1]) == alone, "greedy: the stream's tokens are Submit's"
    assert len(_tokens(per_tag[2])) == 12
    # The two decode in the same steps: a step's outputs of both leave in one message, not one message each.
    both = [r for r in responses if {m.tag for m in r.responses if m.outputs} == {1, 2}]
    assert len(both) >= 6, [[(m.tag, len(m.outputs)) for m in r.responses] for r in responses]


def test_a_refused_request_fails_alone_with_its_status(
    scheduler: scheduler_pb2_grpc.SchedulerStub, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    stream = OpenStream(scheduler)
    try:
        stream.send(_submit(1, 8))
        stream.send(_submit(2, 8, [1, 10**9]))  # outside the vocabulary
        stream.send(_submit(1, 8))  # a tag still in use on this stream: it ends, and the request under it too
        empty_id = _submit(3, 8)
        empty_id.submit.request_id = ""
        stream.send(empty_id)
        stream.send(_submit(4, 8))
        per_tag = _by_tag(stream.read_until_finished({1, 2, 3, 4}))
    finally:
        stream.close()
    (bad,) = per_tag[2]
    assert bad.finished and bad.error_code == "INVALID_ARGUMENT" and bad.error.startswith("prompt_token_ids")
    (no_id,) = per_tag[3]
    assert no_id.error_code == "INVALID_ARGUMENT" and no_id.error.startswith("request_id")
    reused = per_tag[1][-1]
    assert reused.finished and reused.error_code == "INVALID_ARGUMENT" and "tag 1" in reused.error
    assert sum(m.finished for m in per_tag[1]) == 1
    assert len(_tokens(per_tag[4])) == 8 and not per_tag[4][-1].error_code
    assert stats(scheduler_stats).num_requests == 0  # tag 1's request was aborted, not left running


def _wait_freed(stub: scheduler_pb2_grpc.SchedulerStub, free_blocks: int) -> None:
    deadline = time.monotonic() + 5.0
    while (s := stats(stub)).free_blocks != free_blocks or s.num_requests:
        assert time.monotonic() < deadline, f"not freed within 5 s: {s}"
        time.sleep(0.02)


def test_cancel_by_tag_and_the_calls_end_abort_and_free_blocks(
    scheduler: scheduler_pb2_grpc.SchedulerStub, scheduler_stats: scheduler_pb2_grpc.SchedulerStub
) -> None:
    before = stats(scheduler_stats).free_blocks
    stream = OpenStream(scheduler)
    try:
        stream.send(_submit(1, 1000))
        stream.send(_submit(2, 6))
        seen: set[int] = set()
        while 1 not in seen:  # the long one is running (it has tokens)
            seen |= {m.tag for m in stream.responses.get(timeout=120).responses if m.outputs}
        stream.send(scheduler_pb2.StreamRequest(cancel=1))
        rest = _by_tag(stream.read_until_finished({2}))
        assert not rest[2][-1].error_code  # the short one ran on: the cancel was the long one's alone
        assert all(not m.finished for m in rest.get(1, []))  # nothing ends a cancelled tag: it is just gone
        _wait_freed(scheduler_stats, before)
        # The call ending (a frontend gone) aborts every request still on it.
        stream.send(_submit(3, 1000))
        stream.send(_submit(4, 1000))
        seen = set()
        while not {3, 4} <= seen:
            seen |= {m.tag for m in stream.responses.get(timeout=120).responses if m.outputs}
        assert stats(scheduler_stats).num_requests == 2
    finally:
        stream.close()
    _wait_freed(scheduler_stats, before)
