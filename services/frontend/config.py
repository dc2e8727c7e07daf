"""Frontend flags and environment -> a typed config."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_core.config import default_cache_dir
from services.common import ports
from services.common.engine_flags import MODEL_FIELDS, add_engine_flags
from services.common.flags import add_flag, optional_str
from services.common.telemetry import FRONTEND_SERVICE_NAME, TracingSettings, add_tracing_flags
from services.common.tls import TlsFiles
from services.frontend.auth import read_keys
from services.frontend.http_guard import HttpConnectionLimits
from services.frontend.limits import ApiLimits
from services.frontend.replica_discovery import ReplicaSource, parse_replica_source
from services.frontend.routing_policy import ROUTING_POLICIES
from services.frontend.slow_clients import DEFAULT_STREAM_SEND_TIMEOUT
from services.frontend.tool_calls import ToolSettings
from services.frontend.tool_parsers import TOOL_PARSERS

PREFIX_CACHE_ISOLATION = ("none", "api-key")


@dataclass
class FrontendConfig:
    host: str
    grpc_port: int
    http_port: int | None  # None: no HTTP API
    scheduler_addr: str
    replicas: ReplicaSource  # the scheduler replicas `scheduler_addr` names
    routing_policy: str  # round_robin | least_load | prefix: which replica gets a request
    model: str | None  # for the tokenizer (the weights live on the workers)
    tokenizer: str | None
    cache_dir: str
    max_inflight: int
    scheduler_timeout: float
    drain_timeout: float
    tracing: TracingSettings
    limits: ApiLimits
    tls: TlsFiles
    api_keys: list[str]
    enable_client_priority: bool  # off: every request gets priority 0, whatever the client sent
    prefix_cache_isolation: str  # "api-key": each tenant's prompts only hit its own prefix-cache entries
    tokenizer_threads: int
    http_connections: HttpConnectionLimits
    chat_content_special_tokens: bool  # on: special-token text in chat messages is read as control tokens
    stream_send_timeout: float  # seconds a client has to take each stream message before its request is aborted
    tools: ToolSettings  # --enable-auto-tool-choice, --tool-call-parser


def parse_frontend_args(argv: list[str] | None = None) -> FrontendConfig:
    p = argparse.ArgumentParser(prog="pagoda frontend", description="Pagoda frontend: gRPC + OpenAI HTTP API")
    add_flag(p, "--host", default="0.0.0.0", help="address to bind (gRPC and HTTP)")
    add_flag(p, "--grpc-port", default=ports.FRONTEND_GRPC_PORT, type=int, help="public gRPC port (0 picks a free one)")
    add_flag(
        p,
        "--http-port",
        default=ports.FRONTEND_HTTP_PORT,
        type=int,
        help="OpenAI-compatible HTTP port (-1 disables it)",
    )
    add_flag(
        p,
        "--scheduler-addr",
        default=f"localhost:{ports.SCHEDULER_PORT}",
        help="the scheduler replicas: host:port, a comma-separated list, or dns:///name:port (a headless Service)",
    )
    add_flag(
        p,
        "--routing-policy",
        default="prefix",
        help=f"how requests are spread over scheduler replicas: {' | '.join(ROUTING_POLICIES)}",
    )
    add_engine_flags(p, MODEL_FIELDS)
    add_flag(p, "--max-inflight", default=4096, type=int, help="requests in flight before RESOURCE_EXHAUSTED")
    add_flag(p, "--scheduler-timeout", default=600.0, type=float, help="seconds to wait for the scheduler at start")
    add_flag(p, "--drain-timeout", default=20.0, type=float, help="seconds to finish in-flight streams on SIGTERM")
    add_flag(p, "--api-keys", default=None, type=optional_str, help="comma-separated API keys (none: open API)")
    add_flag(p, "--api-keys-file", default=None, type=optional_str, help="file with one API key per line")
    add_flag(p, "--enable-client-priority", default=False, type=bool, help="honour the priority clients send")
    add_flag(p, "--prefix-cache-isolation", default="none", help="none | api-key (per-tenant prefix cache)")
    add_flag(p, "--tokenizer-threads", default=1, type=int, help="threads that tokenize off the event loop")
    add_flag(p, "--http-header-timeout", default=10.0, type=float, help="seconds for an HTTP request's head to arrive")
    add_flag(p, "--http-body-timeout", default=30.0, type=float, help="seconds for an HTTP request's body to arrive")
    add_flag(
        p,
        "--http-max-connections-per-client",
        default=256,
        type=int,
        help="open HTTP connections from one source address (0: no cap; raise it behind a proxy)",
    )
    add_flag(p, "--http-max-connections", default=8192, type=int, help="open HTTP connections in all (0: no cap)")
    add_flag(
        p,
        "--chat-content-special-tokens",
        default=False,
        type=bool,
        help="read special-token text in chat messages as control tokens (trusted callers only; off: plain text)",
    )
    add_flag(
        p,
        "--stream-send-timeout",
        default=DEFAULT_STREAM_SEND_TIMEOUT,
        type=float,
        help="seconds a streaming client may leave a message unread before its request is aborted (RESOURCE_EXHAUSTED)",
    )
    add_flag(
        p,
        "--enable-auto-tool-choice",
        default=False,
        type=bool,
        help='serve tool_choice "auto" (the default with tools): the model\'s own calls, read by --tool-call-parser',
    )
    add_flag(
        p,
        "--tool-call-parser",
        default=None,
        type=optional_str,
        help=f"the model's tool-call format: {' | '.join(sorted(TOOL_PARSERS))}",
    )
    TlsFiles.add_flags(p)
    ApiLimits.add_flags(p)
    add_tracing_flags(p)
    a = p.parse_args(argv)
    if a.prefix_cache_isolation not in PREFIX_CACHE_ISOLATION:
        p.error(f"--prefix-cache-isolation must be one of {PREFIX_CACHE_ISOLATION}, got {a.prefix_cache_isolation!r}")
    if a.routing_policy not in ROUTING_POLICIES:
        p.error(f"--routing-policy must be one of {ROUTING_POLICIES}, got {a.routing_policy!r}")
    try:
        replicas = parse_replica_source(a.scheduler_addr)
        limits, tls = ApiLimits.from_args(a), TlsFiles.from_args(a)
        tools = ToolSettings(a.enable_auto_tool_choice, a.tool_call_parser)
        api_keys = read_keys(a.api_keys, a.api_keys_file)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if a.http_header_timeout <= 0 or a.http_body_timeout <= 0:
        p.error("--http-header-timeout and --http-body-timeout must be > 0")
    if a.http_max_connections_per_client < 0 or a.http_max_connections < 0:
        p.error("--http-max-connections-per-client and --http-max-connections must be >= 0 (0: no cap)")
    if not a.stream_send_timeout > 0:
        p.error(f"--stream-send-timeout must be > 0, got {a.stream_send_timeout}")
    if a.prefix_cache_isolation == "api-key" and not api_keys:
        p.error("--prefix-cache-isolation api-key needs --api-keys or --api-keys-file")
    return FrontendConfig(
        host=a.host,
        grpc_port=a.grpc_port,
        http_port=None if a.http_port < 0 else a.http_port,
        scheduler_addr=a.scheduler_addr,
        replicas=replicas,
        routing_policy=a.routing_policy,
        model=a.model,
        tokenizer=a.tokenizer,
        cache_dir=default_cache_dir(),
        max_inflight=a.max_inflight,
        scheduler_timeout=a.scheduler_timeout,
        drain_timeout=a.drain_timeout,
        tracing=TracingSettings.from_args(a, FRONTEND_SERVICE_NAME),
        limits=limits,
        tls=tls,
        api_keys=api_keys,
        enable_client_priority=a.enable_client_priority,
        prefix_cache_isolation=a.prefix_cache_isolation,
        tokenizer_threads=max(1, a.tokenizer_threads),
        chat_content_special_tokens=a.chat_content_special_tokens,
        http_connections=HttpConnectionLimits(
            header_timeout=a.http_header_timeout,
            body_timeout=a.http_body_timeout,
            max_connections_per_client=a.http_max_connections_per_client,
            max_connections=a.http_max_connections,
        ),
        stream_send_timeout=a.stream_send_timeout,
        tools=tools,
    )
