"""Pagoda's transport-free engine: paged KV cache, continuous batching, prefix caching, sampling."""

from __future__ import annotations

import importlib
from typing import Any

from engine_core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine_core.config import EngineConfig
from engine_core.io.request_output import CompletionOutput, Logprob, RequestOutput
from engine_core.sampling_params import SamplingParams
from engine_core.structured_output.params import StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    # NOTE: `LLM` is imported on first use: importing it loads the model runner, the model and the kernels, and
    # every engine_core module (the frontend imports some, tokenizer-level only) goes through this package.
    if name == "LLM":
        return importlib.import_module("engine_core.llm").LLM
    raise AttributeError(f"module 'engine_core' has no attribute {name!r}")
