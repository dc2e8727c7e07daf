"""The worker's step order under async scheduling: the next step arrives while one runs, possibly first.

WorkerServicer's handlers are driven on an event loop with a tiny Llama; the plans come from the real Scheduler
(step 1 planned ahead of step 0's results, as EngineCore does) and reach the servicer as protobuf messages.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine_core.config import EngineConfig
from engine_core.core.request import Request
from engine_core.core.scheduler import Scheduler
from engine_core.sampling_params import SamplingParams
from services.convert.plan import plan_to_proto, result_from_proto
from services.rpc import worker_pb2
from services.worker import server
from services.worker.config import parse_worker_args

BLOCKS = 16


class Aborted(Exception):
    pass


class Context:
    """What a handler uses of grpc.aio.ServicerContext: abort, which raises."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def plans(n: int) -> list[worker_pb2.ExecuteRequest]:
    """Step 0 (a prefill) and steps 1..n-1 each planned while the one before it is in flight."""
    sched = Scheduler(EngineConfig(num_kv_blocks=BLOCKS, block_size=4), 64, BLOCKS)
    sched.add_request(Request("r", [3, 9, 27, 81], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    out = [sched.schedule()]
    while len(out) < n:
        ahead = sched.schedule_ahead()
        assert ahead is not None
        out.append(ahead)
    msgs = [plan_to_proto(p, epoch="e1", step=i) for i, p in enumerate(out)]
    for msg in msgs:
        msg.return_samples = True
    return msgs


def servicer(model_dir: Path) -> server.WorkerServicer:
    config = parse_worker_args(["--model", str(model_dir), "--num-kv-blocks", str(BLOCKS), "--block-size", "4"])
    worker = server.WorkerServicer(config)
    worker.load()
    return worker


async def init(worker: server.WorkerServicer) -> None:
    await worker.InitCache(worker_pb2.InitCacheRequest(num_blocks=BLOCKS, epoch="e1", world_size=1), Context())


def test_a_step_that_overtakes_its_predecessor_waits_for_it(tiny_dir: Path) -> None:
    worker = servicer(tiny_dir)
    steps = plans(4)

    async def run() -> list[int]:
        await init(worker)
        # Step 2 and 1 arrive before 0, then 3: all run, in order.
        calls = [asyncio.ensure_future(worker.Execute(steps[i], Context())) for i in (2, 1)]
        await asyncio.sleep(0.05)
        calls.insert(0, asyncio.ensure_future(worker.Execute(steps[0], Context())))
        calls.append(asyncio.ensure_future(worker.Execute(steps[3], Context())))
        replies = await asyncio.gather(*calls)
        return [result_from_proto(r).sampled_token_ids[0] for r in replies]

    out_of_order = asyncio.run(run())
    worker2 = servicer(tiny_dir)

    async def in_order() -> list[int]:
        await init(worker2)
        return [result_from_proto(await worker2.Execute(s, Context())).sampled_token_ids[0] for s in steps]

    # replies in `calls` order: 0, 2, 1, 3
    expected = asyncio.run(in_order())
    assert [out_of_order[0], out_of_order[2], out_of_order[1], out_of_order[3]] == expected
    assert worker.next_step == 4


def test_a_step_whose_predecessor_never_comes_is_refused(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "ORDER_WAIT_S", 0.2)
    worker = servicer(tiny_dir)
    steps = plans(2)

    async def run() -> grpc.StatusCode | None:
        await init(worker)
        ctx = Context()
        with pytest.raises(Aborted, match="expected step 0, got 1"):
            await worker.Execute(steps[1], ctx)
        return ctx.code

    assert asyncio.run(run()) is grpc.StatusCode.FAILED_PRECONDITION
