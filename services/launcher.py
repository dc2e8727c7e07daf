"""Starts worker(s), scheduler and frontend as separate local processes and waits until all are healthy.

Used by `pagoda serve` and by the service tests. Stopping drains in dependency order: frontend first (its streams
finish), then the scheduler, then the workers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.common import ports
from services.common.engine_flags import field_default
from services.common.health import SERVING, check
from services.common.tls import TlsFiles
from services.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# NOTE: `pagoda serve --replicas N` puts replica k's scheduler and workers at the first replica's ports + k x 100.
REPLICA_PORT_STRIDE = 100


@dataclass
class ReplicaPorts:
    """One more model replica: a scheduler and its workers."""

    scheduler_port: int
    worker_ports: list[int]


@dataclass
class LaunchConfig:
    model: str | None = None
    dtype: str = field_default("dtype")
    quantization: str | None = field_default("quantization")
    kv_cache_memory: float = field_default("kv_cache_memory")
    kv_cache_dtype: str = field_default("kv_cache_dtype")
    host: str = "0.0.0.0"  # the frontend's bind address; internal services bind to loopback
    grpc_port: int = ports.FRONTEND_GRPC_PORT
    http_port: int = ports.FRONTEND_HTTP_PORT
    scheduler_port: int = ports.SCHEDULER_PORT
    worker_ports: list[int] = field(default_factory=lambda: [ports.WORKER_PORT])
    num_threads: int | None = None
    max_num_seqs: int = field_default("max_num_seqs")
    extra_worker_args: list[str] = field(default_factory=list)
    extra_scheduler_args: list[str] = field(default_factory=list)
    extra_frontend_args: list[str] = field(default_factory=list)
    log_dir: str | None = None  # None: children log to this process's stderr
    # Prometheus: the scheduler's /metrics port; worker rank r gets metrics_port + 1 + r; -1 disables both.
    metrics_port: int = ports.SCHEDULER_METRICS_PORT
    otlp_traces_endpoint: str | None = None  # None: the OTEL_* variables (inherited by every service) decide
    collect_detailed_traces: bool = False
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment for every service
    tls: TlsFiles = field(default_factory=TlsFiles)  # the same files for every service (one test CA)
    # Model replicas after the first (scheduler_port, worker_ports): the frontend routes across all of them.
    extra_replicas: list[ReplicaPorts] = field(default_factory=list)

    @property
    def replicas(self) -> list[ReplicaPorts]:
        return [ReplicaPorts(self.scheduler_port, self.worker_ports), *self.extra_replicas]

    def with_replicas(self, n: int) -> LaunchConfig:
        """N replicas at the first one's ports + k x REPLICA_PORT_STRIDE."""
        step = REPLICA_PORT_STRIDE
        self.extra_replicas = [
            ReplicaPorts(self.scheduler_port + k * step, [p + k * step for p in self.worker_ports]) for k in range(1, n)
        ]
        return self

    @classmethod
    def on_loopback(cls, tensor_parallel_size: int = 1, replicas: int = 1, **overrides: Any) -> LaunchConfig:
        """Every service on 127.0.0.1 with free ports (tests, benchmarks: several clusters may run at once)."""
        n = tensor_parallel_size
        ports = {
            "grpc_port": free_port(),
            "http_port": free_port(),
            "scheduler_port": free_port(),
            "worker_ports": [free_port() for _ in range(n)],
            "extra_replicas": [ReplicaPorts(free_port(), [free_port() for _ in range(n)]) for _ in range(replicas - 1)],
        }
        return cls(host="127.0.0.1", **(ports | overrides))

    def tls_args(self) -> list[str]:
        out: list[str] = []
        for flag, path in (
            ("--tls-cert-file", self.tls.cert_file),
            ("--tls-key-file", self.tls.key_file),
            ("--tls-ca-file", self.tls.ca_file),
        ):
            if path is not None:
                out += [flag, path]
        return out


@dataclass
class Service:
    name: str
    addr: str
    health_service: str
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    restarts: int = 0
    # Every distinct health status seen while waiting (None = unreachable), in order.
    observed: list[int | None] = field(default_factory=list)


class LocalCluster:
    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.services: list[Service] = []

    @property
    def frontend_addr(self) -> str:
        return f"127.0.0.1:{self.config.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.config.http_port}"

    @property
    def scheduler_addr(self) -> str:
        return f"127.0.0.1:{self.config.scheduler_port}"

    @property
    def scheduler_addrs(self) -> list[str]:
        """Every replica's scheduler (the first is `scheduler_addr`)."""
        return [f"127.0.0.1:{r.scheduler_port}" for r in self.config.replicas]

    @staticmethod
    def replica_names(k: int, num_workers: int) -> tuple[str, list[str]]:
        """Replica k's scheduler and worker service names: `scheduler`, `worker0`... for the first (as with one
        replica), `scheduler1`, `worker1-0`... for the next."""
        if k == 0:
            return "scheduler", [f"worker{r}" for r in range(num_workers)]
        return f"scheduler{k}", [f"worker{k}-{r}" for r in range(num_workers)]

    def spawn(
        self, name: str, module: str, args: list[str], addr: str, health_service: str, env: dict[str, str]
    ) -> Service:
        """One more process (`python -m module *args`, environment updated with `env`), waited on and stopped with
        the others; e.g. a service with the exact arguments a Kubernetes manifest gives it."""
        return self._spawn(name, module, args, addr, health_service, env)

    def _spawn(
        self,
        name: str,
        module: str,
        args: list[str],
        addr: str,
        health_service: str,
        extra_env: dict[str, str] | None = None,
    ) -> Service:
        argv = [sys.executable, "-m", module, *args, *self.config.tls_args()]
        env = dict(extra_env or {})
        service = Service(name, addr, health_service, *self._popen(name, argv, env, "wb"), argv=argv, env=env)
        self.services.append(service)
        return service

    def _popen(
        self, name: str, argv: list[str], extra_env: dict[str, str], mode: str
    ) -> tuple[subprocess.Popen[bytes], IO[bytes] | None]:
        log: IO[bytes] | None = None
        if self.config.log_dir is not None:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            log = open(Path(self.config.log_dir) / f"{name}.log", mode)  # noqa: SIM115 - lives as long as the child
        env = dict(os.environ) | self.config.env
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(extra_env)
        return subprocess.Popen(argv, stdout=log, stderr=log, env=env), log

    def restart(self, name: str) -> Service:
        """Starts a service that exited again, with the same arguments (what Kubernetes does for a dead pod)."""
        service = self.service(name)
        if service.process.poll() is None:
            raise RuntimeError(f"{name} is still running")
        if service.log is not None:
            service.log.close()
        service.process, service.log = self._popen(name, service.argv, service.env, "ab")
        service.restarts += 1
        return service

    def _tracing_args(self) -> list[str]:
        c = self.config
        args = ["--otlp-traces-endpoint", c.otlp_traces_endpoint] if c.otlp_traces_endpoint else []
        return args + (["--collect-detailed-traces"] if c.collect_detailed_traces else [])

    def metrics_port(self, service: str) -> int:
        """The /metrics port of a scheduler or worker (-1: off): replica k's block starts at metrics_port +
        k x (1 + workers), its scheduler first, then its workers by rank."""
        c = self.config
        if c.metrics_port < 0:
            return -1
        per_replica = 1 + len(c.worker_ports)
        for k in range(len(c.replicas)):
            scheduler, workers = self.replica_names(k, len(c.worker_ports))
            base = c.metrics_port + k * per_replica
            if service == scheduler:
                return base
            if service in workers:
                return base + 1 + workers.index(service)
        raise KeyError(service)

    def start(self) -> None:
        c = self.config
        model = ["--model", c.model] if c.model else []
        threads = ["--num-threads", str(c.num_threads)] if c.num_threads else []
        tracing = self._tracing_args()
        for k, replica in enumerate(c.replicas):
            scheduler, workers = self.replica_names(k, len(replica.worker_ports))
            # NOTE: a replica's workers are the tensor-parallel ranks of its one model, worker r rank r.
            tp = ["--tensor-parallel-size", str(len(workers))]
            for rank, (name, port) in enumerate(zip(workers, replica.worker_ports, strict=True)):
                # NOTE: no --host: internal services bind to their default, loopback (the security tests check it).
                args = ["--worker-port", str(port), *model, "--dtype", c.dtype, "--kv-cache-dtype", c.kv_cache_dtype]
                args += ["--quantization", c.quantization] if c.quantization else []
                args += ["--metrics-port", str(self.metrics_port(name)), *tracing]
                args += ["--kv-cache-memory", str(c.kv_cache_memory), "--max-num-seqs", str(c.max_num_seqs), *threads]
                args += [*tp, "--rank", str(rank)]
                self._spawn(name, "services.worker", args + c.extra_worker_args, f"127.0.0.1:{port}", WORKER_SERVICE)
            worker_addrs = ",".join(f"127.0.0.1:{p}" for p in replica.worker_ports)
            args = ["--scheduler-port", str(replica.scheduler_port), "--worker-addrs", worker_addrs]
            args += ["--max-num-seqs", str(c.max_num_seqs), "--metrics-port", str(self.metrics_port(scheduler)), *tp]
            args += ["--dist-init-addr", f"127.0.0.1:{free_port()}"] if len(workers) > 1 else []
            addr = f"127.0.0.1:{replica.scheduler_port}"
            self._spawn(
                scheduler, "services.scheduler", args + tracing + c.extra_scheduler_args, addr, SCHEDULER_SERVICE
            )
        args = ["--host", c.host, "--grpc-port", str(c.grpc_port), "--http-port", str(c.http_port)]
        args += ["--scheduler-addr", ",".join(self.scheduler_addrs), *model, *tracing]
        self._spawn(
            "frontend", "services.frontend", args + c.extra_frontend_args, self.frontend_addr, GENERATION_SERVICE
        )

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Polls every service until all report SERVING; fails fast if one of them exits."""
        deadline = time.monotonic() + timeout
        pending = list(self.services)
        while pending:
            for service in list(pending):
                code = service.process.poll()
                if code is not None:
                    raise RuntimeError(f"{service.name} exited with code {code} before becoming healthy")
                status = check(service.addr, service.health_service, timeout=0.5, tls=self.config.tls)
                if not service.observed or service.observed[-1] != status:
                    service.observed.append(status)
                if status == SERVING:
                    pending.remove(service)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout:.0f} s: {[s.name for s in pending]}")
            time.sleep(0.05)

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def stop(self, timeout: float = 60.0) -> dict[str, int | None]:
        """SIGTERM in dependency order (each drains), SIGKILL after `timeout`; returns the exit codes."""
        codes: dict[str, int | None] = {}
        order = sorted(self.services, key=lambda s: 0 if s.name == "frontend" else 1 if "scheduler" in s.name else 2)
        for service in order:
            proc = service.process
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            codes[service.name] = proc.returncode
            if service.log is not None:
                service.log.close()
        return codes

    def addresses(self) -> dict[str, str]:
        out = {"frontend (gRPC)": f"{self.config.host}:{self.config.grpc_port}"}
        if self.config.http_port >= 0:
            out["frontend (OpenAI HTTP)"] = f"http://{self.config.host}:{self.config.http_port}/v1"
        for s in self.services:
            if s.name.startswith(("scheduler", "worker")):
                out[s.name] = s.addr
        if self.config.http_port >= 0:
            out["metrics (frontend)"] = f"http://{self.config.host}:{self.config.http_port}/metrics"
        for s in self.services:
            port = self.metrics_port(s.name) if s.name != "frontend" else -1
            if port >= 0:
                out[f"metrics ({s.name})"] = f"http://127.0.0.1:{port}/metrics"
        return out
