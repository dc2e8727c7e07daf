"""The frontend's router across N scheduler replicas (one channel each): where each request goes, and where its
abort and stop-string `FinishChoice` follow.

Each request is placed by the `RoutingPolicy` among the ready replicas; with `prefix` the prompt's block-hash chain is
computed with the scheduler's own function and salt (`engine_core.core.prefix_cache`), so the overlap is exact, not
guessed from text. A replica that refuses before admitting (UNAVAILABLE: dead, draining, resetting) is marked down
and the request goes to another; once admitted, a request lives and dies with its replica (a failed one ends only its
own requests, with UNAVAILABLE). With one replica this is the single scheduler connection of before.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from engine_core.core.prefix_cache import extend_block_hashes
from services.common.request_scope import scoped_request_id
from services.common.tls import TlsFiles
from services.frontend.replica import Replica
from services.frontend.replica_discovery import ReplicaSource, resolve
from services.frontend.routing_policy import ReplicaView, RoutingPolicy
from services.frontend.scheduler_stats import sum_stats
from services.frontend.scheduler_stream import StreamCall
from services.rpc import common_pb2, scheduler_pb2

log = structlog.get_logger(__name__)

RESOLVE_INTERVAL_S = 5.0


def unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class RoutedCall:
    """One request on the replica the router chose (its `StreamCall` there); re-placed on another while none
    admitted it yet."""

    def __init__(self, router: SchedulerRouter, request: scheduler_pb2.SubmitRequest) -> None:
        self._router = router
        self._request = request
        self._key = scoped_request_id(request.owner, request.request_id)
        self._hashes: list[bytes] | None = None
        self._tried: set[str] = set()
        self._call: StreamCall | None = None
        self.replica: Replica | None = None
        self._admitted = False
        self._cancelled = False

    def __aiter__(self) -> RoutedCall:
        return self

    async def __anext__(self) -> scheduler_pb2.SubmitResponse:
        while True:
            if self._cancelled:
                raise StopAsyncIteration
            if self._call is None:
                self.place()
            assert self._call is not None and self.replica is not None
            try:
                msg = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if self._admitted or e.code() != grpc.StatusCode.UNAVAILABLE:
                    self._release()
                    raise
                # NOTE: refused before admission: nothing ran there, so another replica may take it.
                log.warning("replica refused a request: trying another", replica=self.replica.addr, error=e.details())
                self.replica.serving = False  # until its health check says otherwise
                self._release()
                self._call = None
                continue
            if msg is grpc.aio.EOF:
                self._release()
                raise StopAsyncIteration
            self._admitted = True
            return msg

    def place(self) -> None:
        router = self._router
        ready = [r for r in router.replicas.values() if r.ready and r.addr not in self._tried]
        if not ready:
            raise unavailable("no scheduler replica is ready")
        if router.policy.wants_overlap and self._hashes is None:
            block_size = next((r.index.block_size for r in ready if r.index.block_size), 0)
            salt = self._request.cache_salt or None
            ids = self._request.prompt_token_ids
            self._hashes = extend_block_hashes([], ids, block_size, salt) if block_size else []
        hashes = self._hashes or []
        views = [ReplicaView(r.addr, r.load, r.cached_blocks(hashes) if hashes else 0) for r in ready]
        replica = router.replicas[router.policy.choose(views).name]
        self._tried.add(replica.addr)
        self.replica = replica
        replica.routed(hashes)
        router.owners[self._key] = replica
        self._call = replica.client.submit(self._request)

    def _release(self) -> None:
        replica = self.replica
        if replica is None:
            return
        self.replica = None
        replica.in_flight -= 1
        if self._router.owners.get(self._key) is replica:
            del self._router.owners[self._key]
        self._router.retire_if_idle(replica)

    def cancel(self) -> bool:
        self._cancelled = True
        call = self._call
        self._release()
        return call.cancel() if call is not None else False


class SchedulerRouter:
    """The frontend's scheduler connection(s): the SchedulerClient interface over every replica."""

    def __init__(
        self,
        source: ReplicaSource,
        policy: RoutingPolicy,
        tls: TlsFiles | None = None,
        interceptors: list[grpc.aio.ClientInterceptor] | None = None,
    ) -> None:
        self.source = source
        self.policy = policy
        self.tls = tls
        self.interceptors = interceptors
        self.replicas: dict[str, Replica] = {}
        self.owners: dict[str, Replica] = {}  # scoped request id -> the replica it runs on
        self._leaving: set[Replica] = set()
        self._resolver: asyncio.Future[None] | None = None
        # NOTE: one fixed replica takes every request whatever its KV index and load say, so it is not watched: its
        # scheduler sends a KV-event batch per step and a load report up to 10 times a second that the frontend
        # parses, each a wake-up of both event loops on the cores the worker computes on (docs/benchmarks.md,
        # "Serving at 64 streams against offline"). A DNS name may grow to several replicas: watched.
        self.watch_kv = source.is_dns or len(source.static) > 1

    @property
    def num_ready(self) -> int:
        return sum(r.ready for r in self.replicas.values())

    async def start(self) -> None:
        await self._refresh()
        if self.source.is_dns:
            self._resolver = asyncio.ensure_future(self._resolve_forever())

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(RESOLVE_INTERVAL_S)
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            addrs = await resolve(self.source)
        except OSError as e:
            # NOTE: a DNS hiccup keeps the replicas we know; an empty answer (every pod gone) removes them.
            log.warning("could not resolve the scheduler replicas", host=self.source.dns_host, error=str(e))
            return
        tls_name = self.source.dns_host or None
        for addr in addrs:
            if addr not in self.replicas:
                log.info("replica joined", replica=addr)
                replica = self.replicas[addr] = Replica(addr, self.tls, self.interceptors, tls_name, self.watch_kv)
                replica.start()
        for addr in [a for a in self.replicas if a not in addrs]:
            log.info("replica left", replica=addr)
            replica = self.replicas.pop(addr)
            replica.leaving = True
            self._leaving.add(replica)
            self.retire_if_idle(replica)

    def retire_if_idle(self, replica: Replica) -> None:
        """Closes a replica that left discovery once its last request here ended."""
        if replica in self._leaving and replica.in_flight == 0:
            self._leaving.discard(replica)
            task = asyncio.ensure_future(replica.close())
            task.add_done_callback(lambda _: None)

    async def wait_ready(self, timeout: float) -> scheduler_pb2.InfoResponse:
        """Waits for a replica to serve (the first that does describes the model)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for replica in list(self.replicas.values()):
                if replica.ready:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        return await replica.client.stub.Info(scheduler_pb2.InfoRequest(), timeout=10.0)
            if loop.time() > deadline:
                raise TimeoutError(f"no scheduler replica served within {timeout:.0f} s")
            await asyncio.sleep(0.2)

    def submit(self, request: scheduler_pb2.SubmitRequest) -> RoutedCall:
        """Places the request now; raises UNAVAILABLE (an AioRpcError, as a failed call would) when no replica is
        ready."""
        call = RoutedCall(self, request)
        call.place()
        return call

    async def abort(self, request_id: str, owner: str) -> bool:
        replica = self.owners.get(scoped_request_id(owner, request_id))
        targets = [replica] if replica is not None else [r for r in self.replicas.values() if r.serving]
        if not targets:
            raise unavailable("no scheduler replica is ready")
        # NOTE: a request of another frontend: only its replica knows it, so every replica is asked.
        found = await asyncio.gather(*(r.client.abort(request_id, owner) for r in targets), return_exceptions=True)
        errors = [f for f in found if isinstance(f, grpc.aio.AioRpcError)]
        if len(errors) == len(found):
            raise errors[0]
        return any(f is True for f in found)

    async def finish_choice(
        self, request_id: str, owner: str, index: int, stop: str, trace: common_pb2.TraceContext
    ) -> None:
        replica = self.owners.get(scoped_request_id(owner, request_id))
        if replica is not None:  # NOTE: none: the request already ended
            await replica.client.finish_choice(request_id, owner, index, stop, trace)

    async def stats(self) -> scheduler_pb2.StatsResponse:
        """Every serving replica's Stats, summed (what the frontend's /metrics exports)."""
        replicas = [r for r in self.replicas.values() if r.serving]
        if not replicas:
            raise unavailable("no scheduler replica is ready")
        answers = await asyncio.gather(*(r.client.stats() for r in replicas), return_exceptions=True)
        ok = [a for a in answers if isinstance(a, scheduler_pb2.StatsResponse)]
        if not ok:
            raise next(a for a in answers if isinstance(a, grpc.aio.AioRpcError))
        return sum_stats(ok)

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for replica in [*self.replicas.values(), *self._leaving]:
            await replica.close()
