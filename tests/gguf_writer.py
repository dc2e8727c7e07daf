"""Writing a model's layout as llama.cpp does (gguf-py's names, Q/K rows permuted for its rotary kernel): the one
place the tests and benchmarks/gpu_check_quantized.py make GGUF files from (tiny or safetensors) models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py: Q/K rows as its rotary kernel wants them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_qk_heads(name: str, cfg: Any) -> int | None:
    """The head count whose rows a Llama tensor of gguf-py name `name` permutes (Q or K), else None."""
    if ".attn_q." in name:
        return cfg.num_attention_heads
    if ".attn_k." in name:
        return cfg.num_key_value_heads
    return None


def gguf_writer(path: Path, arch: str, cfg: Any, rope_theta: float = 10000.0) -> GGUFWriter:
    """A writer for `path` with the model-shape metadata of `cfg` (a transformers or engine config) written."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def finish(writer: GGUFWriter) -> None:
    """Header, metadata and tensors to the file, closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
