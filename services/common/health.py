"""Standard gRPC health (grpc.health.v1) for the servers, and clients that wait for SERVING."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.common.tls import TlsFiles, sync_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE = "grpc.health.v1.Health"
# Liveness (Kubernetes livenessProbe): SERVING for as long as the process lives, also while the model loads, while
# draining and while the scheduler re-initializes its workers. Readiness and startup probes use the readiness names.
LIVENESS_SERVICE = "pagoda.liveness"


class ServiceHealth:
    """Health of one server: the overall status ("") and each named service move together (readiness);
    LIVENESS_SERVICE stays SERVING until the process exits."""

    def __init__(self, server: grpc.aio.Server, services: list[str]) -> None:
        # NOTE: the servicer starts with "" SERVING; serve() calls set_serving(False) before the server starts.
        self.servicer = health_aio.HealthServicer()
        self.services = ["", *services]
        self.serving = False
        self.draining = False
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, serving: bool) -> None:
        if self.draining:
            return  # NOTE: a drain is final: a late readiness change must not attract traffic again
        await self._set_readiness(serving)

    async def _set_readiness(self, serving: bool) -> None:
        self.serving = serving
        await self.servicer.set(LIVENESS_SERVICE, SERVING)
        for name in self.services:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def start_draining(self) -> None:
        """Readiness NOT_SERVING from now on, so load balancers route elsewhere; liveness stays SERVING.

        NOTE: not grpc's HealthServicer.enter_graceful_shutdown(): it sets every name NOT_SERVING, liveness included,
        and a liveness probe failing during a drain would have the kubelet kill the pod before its streams finish.
        """
        await self._set_readiness(False)
        self.draining = True


def check(addr: str, service: str = "", timeout: float = 1.0, tls: TlsFiles | None = None) -> int | None:
    """One health check: the status, or None when the server cannot be reached."""
    with sync_channel(addr, tls or TlsFiles(), []) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
        return resp.status


def wait_serving(
    addr: str, service: str = "", timeout: float = 300.0, interval: float = 0.1, tls: TlsFiles | None = None
) -> None:
    """Blocks until `addr` reports SERVING; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check(addr, service, timeout=min(1.0, max(0.05, deadline - time.monotonic())), tls=tls) == SERVING:
            return
        time.sleep(interval)
    raise TimeoutError(f"{addr} did not report SERVING within {timeout:.0f} s")


async def wait_serving_async(channel: grpc.aio.Channel, service: str = "", timeout: float = 300.0) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            if resp.status == SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service or 'server'} did not report SERVING within {timeout:.0f} s")
        await asyncio.sleep(0.1)
