"""The draft model of `speculative_config={"method": "draft_model", "model": ...}`: loaded as the target is, with its
own paged KV cache that shares the target's block ids.

NOTE: the draft's positions are the target's, so the scheduler's block tables serve both caches: block b of the
draft cache holds the draft's K/V of the same tokens as block b of the target's. The draft cache has `scratch` blocks
past the pool's, where a proposal writes the K/V of positions whose block the scheduler has not allocated yet (the
newest token, the drafts): they are never read back after the proposal (draft_runner.py).
"""

from __future__ import annotations

import torch

from engine_core.attention.selector import create_backend
from engine_core.config import EngineConfig
from engine_core.model.layers.cpu_gemm_rows import can_pack
from engine_core.model.layers.layer_ops import select_layer_ops
from engine_core.model.layers.linear import process_linear_weights
from engine_core.model.layers.selector import select_linear_method
from engine_core.model.llama import model_class
from engine_core.model.loader import architecture, iter_weights, load_config
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.worker.paged_kv_cache import PagedKvCache
from engine_core.worker.step_functions import StepFunction
from kernels import cpu as cpu_kernels


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        draft_dir: str,
        target_vocab_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        gemm_dtype: torch.dtype,
    ) -> None:
        """Loads the draft; ValueError (naming both sizes) when its vocabulary is not the target's, or when it cannot
        attend as far as the target serves."""
        hf = load_config(draft_dir)
        if hf.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft model's vocabulary has {hf.vocab_size} tokens, the target's "
                f"{target_vocab_size}; a draft model must use the target's tokenizer"
            )
        limit = int(getattr(hf, "max_position_embeddings", max_model_len))
        if limit < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft model attends to {limit} positions, fewer than max_model_len "
                f"({max_model_len}); lower max_model_len or pick another draft"
            )
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.num_layers = int(hf.num_hidden_layers)
        self.num_kv_heads = int(hf.num_key_value_heads)
        self.head_dim = int(head_dim)
        self.backend = create_backend(
            config.resolved_backend,
            hf.num_attention_heads,
            hf.num_key_value_heads,
            head_dim,
            config.block_size,
            head_dim**-0.5,
            dtype,
        )
        # NOTE: the same construction as the target's (ModelRunner.__init__). The draft's one-token forwards take the
        # native decode step where the target's would (CPU); its catch-up forwards, and every forward on CUDA, run
        # the layer loop (no CUDA graphs for the draft).
        with torch.device(self.device):
            model = model_class(architecture(hf))(hf, self.backend, max_model_len)
        model.load_weights(iter_weights(draft_dir, hf))
        self.model = model.to(dtype=dtype).eval()
        process_linear_weights(self.model, select_linear_method(self.device, dtype, None, gemm_dtype))
        self.model.use_layer_ops(select_layer_ops(self.device, dtype, self.backend.name))
        self.decode_step: StepFunction | None = None
        if can_pack(self.device, dtype) and cpu_kernels.available() and self.backend.name == "cpu":
            self.decode_step = NativeDecodeStep(self.model)
        self.model.rotary.to(torch.float32)
        self.kv = PagedKvCache(self.num_layers, config.block_size, self.num_kv_heads, self.head_dim, dtype, self.device)
        self.block_bytes = self.kv.block_bytes
        self.num_blocks = 0  # the pool's blocks; scratch blocks follow them

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.kv.layers

    def init_kv_cache(self, num_blocks: int, scratch: int, setting: str) -> None:
        # NOTE: no prefault thread beside the target's: its pages fault in as the draft proposes.
        self.kv.allocate(num_blocks + scratch, setting, prefault=False)
        self.num_blocks = num_blocks
