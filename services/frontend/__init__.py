"""The frontend service: tokenizer, validation, detokenization and streaming; gRPC and OpenAI-compatible HTTP."""
