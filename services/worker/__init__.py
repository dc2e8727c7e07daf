"""The worker service: runs engine_core's ModelRunner on the paged KV cache, one step per Execute call."""
