"""The services' default ports, written once: the flags, `pagoda serve` and the launcher read them here (the chart's
values.yaml and deploy/compose.yaml repeat them for their own users; tests/deploy checks they agree)."""

from __future__ import annotations

FRONTEND_GRPC_PORT = 50051  # the public Generate API
FRONTEND_HTTP_PORT = 8000  # OpenAI-compatible HTTP (and the frontend's /metrics)
SCHEDULER_PORT = 50052
WORKER_PORT = 50053  # the first worker's; `pagoda serve` gives worker r WORKER_PORT + r
SCHEDULER_METRICS_PORT = 8001
DIST_INIT_PORT = 29500  # tensor parallelism: rank 0's torch.distributed rendezvous (torch's default MASTER_PORT)
WORKER_METRICS_PORT = 8002  # a worker service's default; `pagoda serve` gives worker r SCHEDULER_METRICS_PORT + 1 + r
