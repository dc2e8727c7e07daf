"""Pagoda's transport-free engine: paged KV cache, continuous batching, prefix caching, sampling."""

from engine_core.config import EngineConfig
from engine_core.llm import LLM
from engine_core.outputs import CompletionOutput, Logprob, RequestOutput
from engine_core.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams"]
