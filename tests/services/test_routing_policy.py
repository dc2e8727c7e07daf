"""The frontend router's pieces that need no process: the policies, the replica list, the summed Stats."""

from __future__ import annotations

import asyncio

import pytest

from services.frontend.replica_discovery import MAX_REPLICAS, parse_replica_source, resolve
from services.frontend.routing_policy import BALANCE_ABS, ReplicaView, RoutingPolicy, imbalanced
from services.frontend.scheduler_stats import sum_stats
from services.rpc import scheduler_pb2


def views(*specs: tuple[int, int]) -> list[ReplicaView]:
    return [ReplicaView(f"r{i}", load, cached) for i, (load, cached) in enumerate(specs)]


def test_round_robin_takes_turns_whatever_the_load_or_cache() -> None:
    policy = RoutingPolicy("round_robin")
    picks = [policy.choose(views((0, 9), (50, 0), (3, 0))).name for _ in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_load_picks_the_idlest_and_rotates_among_equals() -> None:
    policy = RoutingPolicy("least_load")
    assert policy.choose(views((5, 9), (2, 0), (7, 0))).name == "r1"
    assert {policy.choose(views((1, 0), (1, 0))).name for _ in range(4)} == {"r0", "r1"}


def test_prefix_follows_the_longest_cached_prefix_while_balanced() -> None:
    policy = RoutingPolicy("prefix")
    assert policy.choose(views((4, 2), (1, 0), (6, 5))).name == "r2"
    assert policy.choose(views((4, 3), (1, 3))).name == "r1"  # equal overlap: the less loaded
    assert policy.choose(views((4, 0), (1, 0))).name == "r1"  # no overlap anywhere: the least loaded


def test_prefix_falls_back_to_load_when_imbalanced() -> None:
    policy = RoutingPolicy("prefix")
    hot = BALANCE_ABS + 10
    assert imbalanced([hot, 2]) and not imbalanced([hot, hot - BALANCE_ABS]) and not imbalanced([3, 0])
    assert policy.choose(views((hot, 40), (2, 0))).name == "r1"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing_policy"):
        RoutingPolicy("random")


def test_replica_sources_parse_and_refuse_with_the_field_named() -> None:
    src = parse_replica_source("a:1, b:2,a:1")
    assert src.static == ("a:1", "b:2") and not src.is_dns
    dns = parse_replica_source("dns:///pagoda-engine.ns.svc:50052")
    assert dns.is_dns and (dns.dns_host, dns.dns_port) == ("pagoda-engine.ns.svc", 50052)
    for bad in ["", "dns:///nohost", "dns:///h:99999", "host-without-port", ",".join(f"h:{p}" for p in range(300))]:
        with pytest.raises(ValueError, match="scheduler_addr"):
            parse_replica_source(bad)
    assert MAX_REPLICAS < 300


def test_dns_resolves_every_address_of_the_name() -> None:
    addrs = asyncio.run(resolve(parse_replica_source("dns:///localhost:50052")))
    assert "127.0.0.1:50052" in addrs
    assert asyncio.run(resolve(parse_replica_source("x:1,y:2"))) == ["x:1", "y:2"]


def test_stats_of_replicas_are_summed_and_rates_recomputed() -> None:
    a = scheduler_pb2.StatsResponse(
        running=2, free_blocks=10, total_blocks=20, prefix_cache_queries=100, prefix_cache_hits=50, steps=3
    )
    b = scheduler_pb2.StatsResponse(
        running=1, free_blocks=20, total_blocks=20, prefix_cache_queries=100, prefix_cache_hits=100, steps=4
    )
    s = sum_stats([a, b])
    assert (s.running, s.free_blocks, s.total_blocks, s.steps) == (3, 30, 40, 7)
    assert s.kv_usage == pytest.approx(0.25) and s.prefix_cache_hit_rate == pytest.approx(0.75)
    assert sum_stats([a]) is a
