"""`pagoda serve --replicas N`: where each replica's scheduler and workers listen and what the frontend is told."""

from __future__ import annotations

from services.launcher import REPLICA_PORT_STRIDE, LaunchConfig, LocalCluster


def test_replicas_get_their_own_ports_names_and_metrics_ports() -> None:
    config = LaunchConfig(scheduler_port=50052, worker_ports=[50053, 50054], metrics_port=8001).with_replicas(3)
    assert [r.scheduler_port for r in config.replicas] == [50052, 50052 + REPLICA_PORT_STRIDE, 50252]
    assert config.replicas[2].worker_ports == [50253, 50254]
    cluster = LocalCluster(config)
    assert cluster.scheduler_addrs == ["127.0.0.1:50052", "127.0.0.1:50152", "127.0.0.1:50252"]
    assert LocalCluster.replica_names(0, 2) == ("scheduler", ["worker0", "worker1"])
    assert LocalCluster.replica_names(2, 2) == ("scheduler2", ["worker2-0", "worker2-1"])
    ports = [cluster.metrics_port(n) for k in range(3) for n in [LocalCluster.replica_names(k, 2)[0]]]
    ports += [cluster.metrics_port(w) for k in range(3) for w in LocalCluster.replica_names(k, 2)[1]]
    assert len(set(ports)) == 9 and min(ports) == 8001  # one port each, the first replica's as before
    assert cluster.metrics_port("worker1") == 8003


def test_one_replica_is_the_single_cluster_of_before() -> None:
    config = LaunchConfig.on_loopback().with_replicas(1)
    assert len(config.replicas) == 1 and config.extra_replicas == []
    assert LocalCluster(config).scheduler_addrs == [LocalCluster(config).scheduler_addr]
