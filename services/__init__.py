"""Pagoda's gRPC services: frontend (tokenizer + API gateway), scheduler (EngineCore) and workers (ModelRunner)."""
