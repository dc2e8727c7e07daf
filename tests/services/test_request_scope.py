"""The scheduler keys requests by (owner, request_id): what keeps tenants apart across frontends (each frontend only
knows its own streams, so the scheduler is where two frontends' requests meet)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.launcher import LocalCluster
from services.rpc import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.services.probes import all_blocks_free, wait_until

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 260, 1345, 28, 216]


@pytest.fixture(scope="module")
def scheduler(cluster: LocalCluster) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with grpc.insecure_channel(cluster.scheduler_addr) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def _submit(rid: str, owner: str, max_tokens: int) -> scheduler_pb2.SubmitRequest:
    sampling = common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, owner=owner)


def _tokens(first: scheduler_pb2.SubmitResponse, rest: Iterator[scheduler_pb2.SubmitResponse]) -> list[int]:
    return [t for m in (first, *rest) for o in m.outputs for t in o.new_token_ids]


def test_same_id_of_two_owners_is_two_requests(
    cluster: LocalCluster, scheduler: scheduler_pb2_grpc.SchedulerStub
) -> None:
    owners = ("key-aaaa", "key-bbbb", "")
    calls = {owner: scheduler.Submit(_submit("same", owner, 300)) for owner in owners}
    firsts = {owner: next(call) for owner, call in calls.items()}  # every one admitted
    with pytest.raises(grpc.RpcError) as info:
        next(scheduler.Submit(_submit("same", "key-aaaa", 4)))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # Another owner's abort and FinishChoice reach nothing: key-aaaa's request is untouched.
    assert not scheduler.Abort(common_pb2.AbortRequest(request_id="same", owner="key-cccc"), timeout=10).found
    scheduler.FinishChoice(scheduler_pb2.FinishChoiceRequest(request_id="same", owner="key-cccc", stop="x"), timeout=10)
    # key-bbbb ends its own choice: only its request stops early.
    scheduler.FinishChoice(scheduler_pb2.FinishChoiceRequest(request_id="same", owner="key-bbbb", stop="x"), timeout=10)
    tokens = {owner: _tokens(firsts[owner], call) for owner, call in calls.items()}
    assert len(tokens["key-aaaa"]) == 300
    assert tokens[""] == tokens["key-aaaa"]  # greedy, same prompt: the same tokens
    assert len(tokens["key-bbbb"]) < 300
    wait_until(lambda: all_blocks_free(cluster.scheduler_addr), 30, "every KV block free")


def test_owner_with_the_separator_is_refused(scheduler: scheduler_pb2_grpc.SchedulerStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        next(scheduler.Submit(_submit("x", "key-a/b", 4)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "owner" in (info.value.details() or "")
