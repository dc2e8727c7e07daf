"""Where the scheduler replicas are: a static list (`host:port,host:port`) or the DNS of a headless Service
(`dns:///name:port`, re-resolved: a pod that appears joins, one that disappears leaves)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

DNS_PREFIX = "dns:///"
MAX_REPLICAS = 256  # NOTE: a resolver answer is untrusted input too: one channel and two streams per replica


@dataclass(frozen=True)
class ReplicaSource:
    static: tuple[str, ...] = ()
    dns_host: str = ""  # with dns_port: resolved every `resolve_interval` seconds
    dns_port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_host)


def parse_replica_source(value: str) -> ReplicaSource:
    """`--scheduler-addr`: one address, a comma-separated list, or `dns:///name:port`. Raises ValueError."""
    value = value.strip()
    if value.startswith(DNS_PREFIX):
        host, sep, port = value[len(DNS_PREFIX) :].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"scheduler_addr {value!r}: expected dns:///name:port")
        return ReplicaSource(dns_host=host, dns_port=int(port))
    addrs = tuple(dict.fromkeys(a.strip() for a in value.split(",") if a.strip()))
    if not addrs:
        raise ValueError("scheduler_addr must name at least one scheduler")
    if len(addrs) > MAX_REPLICAS:
        raise ValueError(f"scheduler_addr names {len(addrs)} schedulers, at most {MAX_REPLICAS}")
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"scheduler_addr {a!r}: expected host:port")
    return ReplicaSource(static=addrs)


async def resolve(source: ReplicaSource) -> list[str]:
    """The replicas' addresses now (DNS: every address the name has; raises OSError when it does not resolve)."""
    if not source.is_dns:
        return list(source.static)
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(source.dns_host, source.dns_port, type=socket.SOCK_STREAM)
    addrs: dict[str, None] = {}
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        addrs[f"[{ip}]:{source.dns_port}" if family == socket.AF_INET6 else f"{ip}:{source.dns_port}"] = None
    return sorted(addrs)[:MAX_REPLICAS]
