"""The liveness name stays SERVING through load, readiness changes and drain; readiness follows the server."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health import LIVENESS_SERVICE, NOT_SERVING, SERVING, ServiceHealth

OWN = "pagoda.v1.Example"


async def _statuses(stub: health_pb2_grpc.HealthStub) -> dict[str, int]:
    out = {}
    for name in ("", OWN, LIVENESS_SERVICE):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        out[name] = resp.status
    return out


async def _lifecycle() -> list[dict[str, int]]:
    server = grpc.aio.server()
    health = ServiceHealth(server, [OWN])
    await health.set_serving(False)  # what every serve() does before the model or the scheduler is there
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            seen.append(await _statuses(stub))  # loading
            await health.set_serving(True)
            seen.append(await _statuses(stub))  # ready
            await health.set_serving(False)
            seen.append(await _statuses(stub))  # e.g. the scheduler re-initializing its workers
            await health.set_serving(True)
            await health.start_draining()
            seen.append(await _statuses(stub))  # draining
            await health.set_serving(True)  # a late readiness change (e.g. the scheduler's watcher) is ignored
            seen.append(await _statuses(stub))
    finally:
        await server.stop(None)
    return seen


def test_liveness_stays_serving_while_readiness_follows_the_lifecycle() -> None:
    loading, ready, reinit, draining, late = asyncio.run(_lifecycle())
    down = {"": NOT_SERVING, OWN: NOT_SERVING, LIVENESS_SERVICE: SERVING}
    assert loading == down
    assert ready == {"": SERVING, OWN: SERVING, LIVENESS_SERVICE: SERVING}
    assert reinit == down
    assert draining == down
    assert late == down
