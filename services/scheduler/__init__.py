"""The scheduler service: engine_core's EngineCore (block tables, prefix cache, continuous batching) behind gRPC."""
