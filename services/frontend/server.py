"""The frontend process: public gRPC (with reflection) and the OpenAI HTTP API on one event loop.

Startup: gRPC listens at once (health NOT_SERVING, Generate UNAVAILABLE), the tokenizer loads, the scheduler is
awaited; then the HTTP API starts and health turns SERVING. SIGTERM drains: NOT_SERVING, new requests refused
(UNAVAILABLE / 503), streams in flight run to completion, then both servers stop.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from prometheus_client import CollectorRegistry

from engine_core.checkpoint.model_files import model_name, read_generation_eos, resolve_model_dir
from engine_core.io.tokenizer import load_tokenizer
from services.common.grpc_opts import server_options
from services.common.health import HEALTH_SERVICE, ServiceHealth
from services.common.logs import configure_logging
from services.common.metrics import service_registry
from services.common.signals import ignore_late_signals, shutdown_event
from services.common.telemetry import Telemetry, setup_tracing
from services.common.tls import add_port
from services.frontend.auth import ApiKeys
from services.frontend.config import FrontendConfig, parse_frontend_args
from services.frontend.grpc_api import GenerationServicer
from services.frontend.http_guard import GuardedConfig
from services.frontend.http_server import HttpServer
from services.frontend.metrics import RequestMetrics, add_metrics_route
from services.frontend.openai_api import create_app
from services.frontend.pipeline import AdmissionPolicy, RequestPipeline
from services.frontend.request import ModelDescription
from services.frontend.router import SchedulerRouter
from services.frontend.routing_policy import RoutingPolicy
from services.frontend.tokenization import PromptTokenizer
from services.rpc import GENERATION_SERVICE, generation_pb2_grpc

log = structlog.get_logger(__name__)


async def _load_pipeline(
    config: FrontendConfig, client: SchedulerRouter, registry: CollectorRegistry, telemetry: Telemetry | None
) -> RequestPipeline:
    model_dir = await asyncio.to_thread(resolve_model_dir, config.model, config.cache_dir)
    model_tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer or model_dir, config.cache_dir)
    info = await client.wait_ready(config.scheduler_timeout)
    if info.model != model_name(config.model):
        log.warning(
            "the frontend's tokenizer model differs from the workers'",
            frontend=model_name(config.model),
            workers=info.model,
        )
    eos = model_tokenizer.eos_token_id
    if eos is None:
        eos = next(iter(read_generation_eos(model_dir)), None)
    tokenizer = PromptTokenizer(
        model_tokenizer, info.vocab_size, info.max_model_len, config.chat_content_special_tokens
    )
    model = ModelDescription(
        name=info.model,
        architecture=info.architecture,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        eos_token_id=eos,
        has_chat_template=tokenizer.has_chat_template,
    )
    policy = AdmissionPolicy(
        max_inflight=config.max_inflight,
        limits=config.limits,
        enable_client_priority=config.enable_client_priority,
        prefix_cache_isolation=config.prefix_cache_isolation,
        tokenizer_threads=config.tokenizer_threads,
    )
    metrics = RequestMetrics(registry, model.name, model.max_model_len)
    return RequestPipeline(tokenizer, client, model, policy, metrics, telemetry)


async def _watch_scheduler(client: SchedulerRouter, health: ServiceHealth, pipeline: RequestPipeline) -> None:
    """Serving while at least one scheduler replica serves: a frontend without one must not attract traffic."""
    while not pipeline.draining:
        up = client.num_ready > 0
        if up != health.serving and not pipeline.draining:
            log.warning("scheduler health changed", serving=up, replicas=len(client.replicas))
            await health.set_serving(up)
        await asyncio.sleep(0.5)


async def serve(config: FrontendConfig, telemetry: Telemetry | None = None) -> int:
    server = grpc.aio.server(
        options=server_options(config.limits.max_request_bytes),
        interceptors=telemetry.server_interceptors() if telemetry is not None else None,
    )
    keys = ApiKeys(config.api_keys)
    servicer = GenerationServicer(keys, config.limits, config.stream_send_timeout)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    health = ServiceHealth(server, [GENERATION_SERVICE])
    await health.set_serving(False)
    reflection.enable_server_reflection([GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    # NOTE: the public listener never asks for client certificates: clients authenticate with API keys.
    grpc_port = add_port(server, f"{config.host}:{config.grpc_port}", config.tls, require_client_cert=False)
    await server.start()
    log.info("frontend gRPC listening", addr=f"{config.host}:{grpc_port}", scheduler=config.scheduler_addr)
    stop = shutdown_event()
    client = SchedulerRouter(
        config.replicas,
        RoutingPolicy(config.routing_policy),
        config.tls,
        telemetry.client_interceptors() if telemetry is not None else None,
    )
    await client.start()
    registry = service_registry()
    loading = asyncio.ensure_future(_load_pipeline(config, client, registry, telemetry))
    await asyncio.wait([loading, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        loading.cancel()
        await server.stop(grace=1.0)
        return 0
    pipeline = loading.result()
    servicer.pipeline = pipeline
    http: HttpServer | None = None
    http_task: asyncio.Future[None] | None = None
    if config.http_port is not None:
        app = create_app(pipeline, lambda: health.serving, keys, config.stream_send_timeout, config.tools)
        add_metrics_route(app, registry, pipeline.model.name, client.stats)
        if telemetry is not None:
            # NOTE: no spans for each ASGI send/receive (one per streamed chunk), nor for probes and scrapes.
            FastAPIInstrumentor.instrument_app(
                app,
                tracer_provider=telemetry.provider,
                excluded_urls="/health,/metrics",
                exclude_spans=["receive", "send"],
            )
        uv_config = GuardedConfig(
            app,
            config.http_connections,
            host=config.host,
            port=config.http_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=config.tls.cert_file,
            ssl_keyfile=config.tls.key_file,
        )
        http = HttpServer(uv_config)
        http_task = asyncio.ensure_future(http.serve())
        while not http.started and not http_task.done():
            await asyncio.sleep(0.02)
        if http_task.done():
            http_task.result()  # NOTE: the port was taken: fail loudly
        log.info("frontend HTTP listening", addr=f"{config.host}:{config.http_port}")
    await health.set_serving(True)
    watcher = asyncio.ensure_future(_watch_scheduler(client, health, pipeline))
    log.info("frontend ready", model=pipeline.model.name)
    await stop.wait()

    log.info("draining", in_flight=len(pipeline.active))
    pipeline.draining = True
    watcher.cancel()
    await health.start_draining()
    deadline = time.monotonic() + config.drain_timeout
    while pipeline.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if http is not None and http_task is not None:
        http.should_exit = True
        # NOTE: streams still open at the deadline must not hold the exit past the drain timeout (Kubernetes
        # would SIGKILL us mid-cleanup): uvicorn then closes their connections instead of waiting for them.
        http.force_exit = bool(pipeline.active)
        await http_task
    await server.stop(grace=2.0)
    await client.close()
    log.info("frontend stopped", unfinished=len(pipeline.active))
    return 0


def main(argv: list[str] | None = None) -> int:
    configure_logging("frontend")
    config = parse_frontend_args(argv)
    telemetry = setup_tracing(config.tracing)
    try:
        code = asyncio.run(serve(config, telemetry))
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # NOTE: after the drain: the spans of the last requests are flushed
    ignore_late_signals()
    return code
