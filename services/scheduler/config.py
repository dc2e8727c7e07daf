"""Scheduler flags and environment -> a typed config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_core.config import EngineConfig
from engine_core.spec_decode.config import SpeculativeConfig
from services.common import ports
from services.common.engine_flags import SCHEDULER_FIELDS, add_engine_flags, engine_config_from_args
from services.common.flags import add_flag
from services.common.telemetry import SCHEDULER_SERVICE_NAME, TracingSettings, add_tracing_flags
from services.common.tls import TlsFiles
from services.scheduler.executor import StepDeadline


@dataclass
class SchedulerConfig:
    host: str
    port: int
    worker_addrs: list[str]  # rank order: rank 0 returns the samples
    dist_init_addr: str  # tensor parallelism: the ranks' rendezvous, sent in every InitCache
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: str
    async_scheduling: bool
    enable_prefix_caching: bool
    num_kv_blocks: int | None
    speculative_config: SpeculativeConfig | None  # the scheduler proposes the drafts (it owns the tokens)
    structured_outputs_compile_timeout: float  # the grammar gate's deadline (the scheduler holds the requests)
    max_waiting_requests: int  # beyond this, Submit answers RESOURCE_EXHAUSTED
    worker_timeout: float  # seconds to wait for the workers at start
    # After a worker failure: seconds to re-form the group before the held streams end UNAVAILABLE.
    worker_reform_timeout: float
    step_timeout: float  # base seconds one Execute may take before the worker counts as failed (hung or dead)
    step_timeout_per_token: float  # plus this much per scheduled token: the deadline scales with the step
    heartbeat_interval: float  # idle: seconds between checks that every worker is alive and on our cache epoch
    heartbeat_timeout: float
    drain_timeout: float
    metrics_port: int  # Prometheus /metrics (-1: off)
    tracing: TracingSettings
    tls: TlsFiles

    def engine_config(self, block_size: int, max_model_len: int, num_blocks: int) -> EngineConfig:
        """The EngineCore's config: these flags with what the workers reported (block size, context, KV blocks)."""
        return EngineConfig(
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            scheduling_policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            enable_prefix_caching=self.enable_prefix_caching,
            num_kv_blocks=num_blocks,
            speculative_config=self.speculative_config,
            structured_outputs_compile_timeout=self.structured_outputs_compile_timeout,
        )


def parse_scheduler_args(argv: list[str] | None = None) -> SchedulerConfig:
    p = argparse.ArgumentParser(prog="pagoda scheduler", description="Pagoda scheduler: continuous batching")
    add_flag(p, "--host", default="127.0.0.1", help="address to bind (internal: loopback unless told otherwise)")
    add_flag(p, "--scheduler-port", default=ports.SCHEDULER_PORT, type=int, help="gRPC port (0 picks a free one)")
    add_flag(
        p,
        "--worker-addrs",
        default=f"localhost:{ports.WORKER_PORT}",
        help="comma-separated worker addresses, rank order",
    )
    add_flag(
        p,
        "--dist-init-addr",
        default="",
        help=f"tensor parallelism: the ranks' rendezvous host:port (default: rank 0's host:{ports.DIST_INIT_PORT})",
    )
    add_engine_flags(p, SCHEDULER_FIELDS)
    add_flag(p, "--max-waiting-requests", default=1024, type=int, help="queued requests before RESOURCE_EXHAUSTED")
    add_flag(p, "--worker-timeout", default=600.0, type=float, help="seconds to wait for workers to be ready")
    add_flag(
        p,
        "--worker-reform-timeout",
        default=120.0,
        type=float,
        help="seconds to re-form the workers after a failure before the streams they held end UNAVAILABLE",
    )
    d = StepDeadline()
    add_flag(p, "--step-timeout", default=d.base_s, type=float, help="base seconds of a step (then: worker hung)")
    add_flag(p, "--step-timeout-per-token", default=d.per_token_s, type=float, help="extra step seconds per token")
    add_flag(p, "--heartbeat-interval", default=2.0, type=float, help="idle seconds between worker heartbeats")
    add_flag(p, "--heartbeat-timeout", default=5.0, type=float, help="seconds a worker has to answer a heartbeat")
    add_flag(p, "--drain-timeout", default=20.0, type=float, help="seconds to finish in-flight requests on SIGTERM")
    TlsFiles.add_flags(p)
    add_flag(
        p,
        "--metrics-port",
        default=ports.SCHEDULER_METRICS_PORT,
        type=int,
        help="Prometheus /metrics port on --host (-1 disables)",
    )
    add_tracing_flags(p)
    a = p.parse_args(argv)
    try:
        tls = TlsFiles.from_args(a)
    except ValueError as e:
        p.error(str(e))
    workers = [w.strip() for w in a.worker_addrs.split(",") if w.strip()]
    if not workers:
        p.error("--worker-addrs must name at least one worker")
    try:
        engine_config_from_args(a, SCHEDULER_FIELDS)  # NOTE: validates the engine flags with EngineConfig's rules
    except ValueError as e:
        p.error(str(e))
    if len(workers) != a.tensor_parallel_size:
        p.error(
            f"--worker-addrs names {len(workers)} worker(s) but --tensor-parallel-size is {a.tensor_parallel_size}: "
            "one worker per rank"
        )
    dist_init_addr = a.dist_init_addr or f"{workers[0].rpartition(':')[0]}:{ports.DIST_INIT_PORT}"
    return SchedulerConfig(
        host=a.host,
        port=a.scheduler_port,
        worker_addrs=workers,
        dist_init_addr=dist_init_addr,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        scheduling_policy=a.scheduling_policy,
        async_scheduling=a.async_scheduling,
        enable_prefix_caching=a.enable_prefix_caching,
        num_kv_blocks=a.num_kv_blocks,
        speculative_config=a.speculative_config,
        structured_outputs_compile_timeout=a.structured_outputs_compile_timeout,
        max_waiting_requests=a.max_waiting_requests,
        worker_timeout=a.worker_timeout,
        worker_reform_timeout=a.worker_reform_timeout,
        step_timeout=a.step_timeout,
        step_timeout_per_token=a.step_timeout_per_token,
        heartbeat_interval=a.heartbeat_interval,
        heartbeat_timeout=a.heartbeat_timeout,
        drain_timeout=a.drain_timeout,
        metrics_port=a.metrics_port,
        tracing=TracingSettings.from_args(a, SCHEDULER_SERVICE_NAME),
        tls=tls,
    )
