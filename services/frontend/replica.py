"""One scheduler replica behind the frontend's router: its channel, health, KV index, load and requests in flight.

`watch` keeps one WatchKvEvents stream open (resubscribing from the last batch after a gap, a drop or a failure;
not when the router has this replica alone, `watch_kv`) and polls the scheduler's health every second. While either
is down the replica takes no new requests and its index is emptied (what it knew may be stale); its requests in
flight end on their own (a dead scheduler's streams fail with UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.health import SERVING
from services.common.tls import TlsFiles
from services.frontend.kv_index import KvIndex
from services.frontend.scheduler_client import SchedulerClient
from services.rpc import SCHEDULER_SERVICE, scheduler_pb2

log = structlog.get_logger(__name__)

HEALTH_INTERVAL_S = 1.0
RESUBSCRIBE_S = 0.5
# NOTE: hashes of prompts routed here but not yet reported stored (their prefill runs): the next request of the same
# tenant follows them. Bounded and short-lived: a prediction the replica never confirms stops counting.
PREDICTED_MAX = 65536
PREDICTED_TTL_S = 10.0


class Replica:
    def __init__(
        self,
        addr: str,
        tls: TlsFiles | None,
        interceptors: list[grpc.aio.ClientInterceptor] | None = None,
        tls_name: str | None = None,
        watch_kv: bool = True,
    ) -> None:
        self.addr = addr
        self.watch_kv = watch_kv  # False: no WatchKvEvents stream (the router has no other replica to weigh it against)
        self.client = SchedulerClient(addr, tls, interceptors, tls_name)
        self.index = KvIndex()
        self.serving = False  # the scheduler's health is SERVING
        self.subscribed = False  # its KV events stream is open and applied
        self.in_flight = 0  # requests this frontend has on it
        self.routed_since_load = 0  # routed here since its last load report
        self.leaving = False  # gone from discovery: no new requests, closed once its last request ends
        self._predicted: OrderedDict[bytes, float] = OrderedDict()
        self._task: asyncio.Future[None] | None = None

    @property
    def ready(self) -> bool:
        return self.serving and not self.leaving

    @property
    def load(self) -> int:
        load = self.index.load
        reported = load.running_requests + load.waiting_requests if load is not None else 0
        return max(reported + self.routed_since_load, self.in_flight)

    def cached_blocks(self, block_hashes: list[bytes]) -> int:
        now = time.monotonic()
        n = 0
        for h in block_hashes:
            if h not in self.index.resident:
                t = self._predicted.get(h)
                if t is None or now - t > PREDICTED_TTL_S:
                    break
            n += 1
        return n

    def routed(self, block_hashes: list[bytes]) -> None:
        """A request was just sent here (optimistic accounting until the replica reports)."""
        self.in_flight += 1
        self.routed_since_load += 1
        now = time.monotonic()
        for h in block_hashes:
            self._predicted[h] = now
            self._predicted.move_to_end(h)
        while len(self._predicted) > PREDICTED_MAX:
            self._predicted.popitem(last=False)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.close()

    async def _run(self) -> None:
        if self.watch_kv:
            await asyncio.gather(self._watch_health(), self._watch_events())
        else:
            await self._watch_health()

    async def _watch_health(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.client.channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=2.0)
                up = resp.status == SERVING
            except grpc.aio.AioRpcError:
                up = False
            if up != self.serving:
                log.warning("replica health changed", replica=self.addr, serving=up)
                self.serving = up
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _watch_events(self) -> None:
        while True:
            try:
                call = self.client.stub.WatchKvEvents(
                    scheduler_pb2.WatchKvEventsRequest(from_seq=self.index.seq, stream_id=self.index.stream_id)
                )
                async for batch in call:
                    if not self.index.apply(batch):
                        log.warning("KV events missed: resubscribing", replica=self.addr, seq=self.index.seq)
                        call.cancel()
                        break
                    self.subscribed = True
                    if batch.has_load:
                        self.routed_since_load = 0
            except grpc.aio.AioRpcError as e:
                if self.subscribed:
                    log.warning("KV events stream ended", replica=self.addr, code=e.code().name)
            self.subscribed = False
            await asyncio.sleep(RESUBSCRIBE_S)
