"""Two model replicas (each a scheduler and its worker, real processes) behind one frontend: KV events over the wire,
the `prefix` policy keeping each tenant's prefix on one replica, and failover when a replica's scheduler dies."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_core.core.prefix_cache import extend_block_hashes
from services.client import GenerationClient
from services.common.health import SERVING, check
from services.frontend.kv_index import KvIndex
from services.frontend.replica_discovery import parse_replica_source
from services.frontend.router import SchedulerRouter
from services.frontend.routing_policy import RoutingPolicy
from services.launcher import LaunchConfig, LocalCluster
from services.rpc import (
    GENERATION_SERVICE,
    SCHEDULER_SERVICE,
    common_pb2,
    generation_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.services.probes import all_blocks_free, scheduler_stats, start_healthy, wait_until
from tests.services.test_faults import Reader

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2


@pytest.fixture(scope="module")
def replicas(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    log_dir: Path = tmp_path_factory.mktemp("replicas")
    config = LaunchConfig.on_loopback(
        replicas=2,
        dtype="float32",
        kv_cache_memory=0.25,
        num_threads=1,
        max_num_seqs=16,
        log_dir=str(log_dir),
        metrics_port=-1,
    )
    c = start_healthy(config)
    yield c
    codes = c.stop(timeout=60)
    assert set(codes.values()) == {0}, codes


@pytest.fixture(scope="module")
def client(replicas: LocalCluster) -> Iterator[GenerationClient]:
    with GenerationClient(replicas.frontend_addr) as c:
        yield c


def ids_request(ids: list[int], max_tokens: int = 2, **sampling: object) -> generation_pb2.GenerateRequest:
    opts = common_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, **sampling)  # type: ignore[arg-type]
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), sampling=opts)


def snapshot(addr: str) -> KvIndex:
    """A late subscriber's picture of one scheduler's prefix cache (its snapshot)."""
    index = KvIndex()
    with grpc.insecure_channel(addr) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).WatchKvEvents(scheduler_pb2.WatchKvEventsRequest(), timeout=30)
        for batch in call:
            assert index.apply(batch)
            if batch.reset:
                call.cancel()
                break
    return index


def test_kv_events_name_exactly_the_blocks_of_a_served_prompt(replicas: LocalCluster, client: GenerationClient) -> None:
    prompt = [random.Random(1).randrange(100, VOCAB) for _ in range(70)]
    result = client.generate(ids_request(prompt))
    assert result.final is not None and result.final.usage.completion_tokens == 2
    indexes = [snapshot(a) for a in replicas.scheduler_addrs]
    block_size = indexes[0].block_size
    assert block_size > 0
    hashes = extend_block_hashes([], prompt, block_size, None)
    assert len(hashes) >= 2
    holding = [i for i in indexes if i.cached_blocks(hashes) == len(hashes)]
    assert len(holding) == 1, "one replica served it and holds every full block of its prompt"


def test_a_router_finds_the_replicas_behind_a_dns_name(replicas: LocalCluster) -> None:
    port = replicas.config.scheduler_port

    async def run() -> tuple[list[str], int, int]:
        router = SchedulerRouter(parse_replica_source(f"dns:///localhost:{port}"), RoutingPolicy("prefix"))
        await router.start()
        try:
            info = await router.wait_ready(60)
            return sorted(router.replicas), info.block_size, router.num_ready
        finally:
            await router.close()

    addrs, block_size, ready = asyncio.run(run())
    assert f"127.0.0.1:{port}" in addrs and block_size > 0 and ready >= 1


def test_a_router_watches_kv_events_only_where_it_has_replicas_to_choose_between(replicas: LocalCluster) -> None:
    first, second = replicas.scheduler_addrs

    async def subscribed(source: str) -> dict[str, bool]:
        router = SchedulerRouter(parse_replica_source(source), RoutingPolicy("prefix"))
        await router.start()
        try:
            await router.wait_ready(60)
            deadline = asyncio.get_running_loop().time() + 10
            # NOTE: a watched replica's stream opens with a snapshot (block_size 0 until one arrives)
            while not all(r.subscribed for r in router.replicas.values() if r.watch_kv):
                assert asyncio.get_running_loop().time() < deadline, "a watched replica never subscribed"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # long enough for an unwatched one to have subscribed, were it watched
            return {addr: r.subscribed for addr, r in router.replicas.items()}
        finally:
            await router.close()

    assert asyncio.run(subscribed(first)) == {first: False}
    assert asyncio.run(subscribed(f"{first},{second}")) == {first: True, second: True}


def test_prefix_policy_keeps_each_tenants_prefix_on_one_replica(client: GenerationClient) -> None:
    rng = random.Random(2)
    systems = [[rng.randrange(100, VOCAB) for _ in range(96)] for _ in range(3)]
    cached: list[int] = []
    for turn in range(3):
        for system in systems:
            tail = [rng.randrange(100, VOCAB) for _ in range(5)]
            final = client.generate(ids_request(system + tail)).final
            assert final is not None
            if turn:
                cached.append(final.usage.cached_prompt_tokens)
    # NOTE: round_robin would send every other request of a tenant to the replica without its prefix (0 cached).
    assert all(c >= 80 for c in cached), cached


def test_abort_and_stop_strings_reach_the_replica_that_runs_the_request(
    replicas: LocalCluster, client: GenerationClient
) -> None:
    rng = random.Random(4)
    request = ids_request([rng.randrange(100, VOCAB) for _ in range(20)], 400, ignore_eos=True)
    request.request_id = "abort-me"
    reader = Reader(client, request)
    assert reader.tokens.wait(120)
    assert client.abort("abort-me") is True
    reader.join(60)
    assert reader.error is None
    finals = [c.finish_reason for m in reader.messages for c in m.choices if c.finish_reason]
    assert finals == [common_pb2.FINISH_REASON_ABORT]
    assert client.abort("abort-me") is False  # ended: no replica knows it
    for addr in replicas.scheduler_addrs:
        wait_until(lambda a=addr: all_blocks_free(a), 30, f"every block of {addr} free after the abort")


def test_a_dead_replica_fails_only_its_requests_and_rejoins_when_restarted(
    replicas: LocalCluster, client: GenerationClient
) -> None:
    rng = random.Random(3)
    long = Reader(client, ids_request([rng.randrange(100, VOCAB) for _ in range(20)], 400, ignore_eos=True))
    assert long.tokens.wait(120)
    names = ["scheduler", "scheduler1"]
    busy = [
        n for n, a in zip(names, replicas.scheduler_addrs, strict=True) if (s := scheduler_stats(a)) and s.num_requests
    ]
    assert len(busy) == 1, busy
    victim = replicas.service(busy[0])
    victim.process.kill()
    victim.process.wait(30)
    long.join(60)
    assert long.error is not None and long.error.code() == grpc.StatusCode.UNAVAILABLE, long.error
    for _ in range(4):  # every later request succeeds on the other replica, at once
        result = client.generate(ids_request([rng.randrange(100, VOCAB) for _ in range(20)]))
        assert result.final is not None and result.final.usage.completion_tokens == 2
    assert check(replicas.frontend_addr, GENERATION_SERVICE) == SERVING
    replicas.restart(victim.name)
    wait_until(lambda: check(victim.addr, SCHEDULER_SERVICE) == SERVING, 120, "the restarted scheduler serves")

    def victim_served() -> bool:
        client.generate(ids_request([rng.randrange(100, VOCAB) for _ in range(20)]))
        s = scheduler_stats(victim.addr)
        return s is not None and s.steps > 0

    wait_until(victim_served, 60, "the restarted replica takes requests again")
    for addr in replicas.scheduler_addrs:  # nothing leaked on either replica
        wait_until(lambda a=addr: all_blocks_free(a), 30, f"every block of {addr} free")
