"""Pagoda's Llama-family model (Llama, Mistral, Qwen2) over a flattened token batch and the paged KV cache.

Shapes: the step's tokens are flattened to `[num_tokens]`; attention goes through the attention backend, which
reads and writes K/V in the paged cache. Q/K/V and gate/up projections are fused into one GEMM each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine_core.attention.backend import AttentionBackend, AttentionMetadata
from engine_core.distributed.parallel_state import SINGLE, TensorParallel, check_heads, kv_heads_per_rank
from engine_core.model.layers.block_codes import BlockCodes
from engine_core.model.layers.coded_embedding import CodedEmbedding
from engine_core.model.layers.int8_embedding import Int8Embedding
from engine_core.model.layers.layer_ops import TORCH_OPS, LayerOps
from engine_core.model.layers.linear import Linear
from engine_core.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, qkv_parallel
from engine_core.model.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

if TYPE_CHECKING:
    from engine_core.checkpoint.model_config import ModelConfig


class Embedding(nn.Embedding):
    """`nn.Embedding` without the random initialization.

    NOTE: `load_weights` overwrites every parameter and fails on a missing one, so a random init is wasted: ~0.7 s
    of SmolLM2's start-up went to `kaiming_uniform_` and `normal_` over its 134M weights (model/layers/linear.py's
    `Linear` allocates only, too).
    """

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops: LayerOps = TORCH_OPS  # the runner's choice (layer_ops.py), see LlamaForCausalLM.use_layer_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add is fused into the norm call."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, built once with transformers' own rope-parameter functions."""

    def __init__(self, config: ModelConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            # NOTE: imported here: only a scaled RoPE needs transformers (its config came through AutoConfig).
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, `[T, 1, D]`: looked up once per step, shared by all layers."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism: model/layers/parallel_linear.py)."""

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, qkv_bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads = heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(kv_heads, tp.size)
        self.head_dim = backend.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = qkv_parallel(config.hidden_size, heads, kv_heads, self.head_dim, qkv_bias, tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, tp)
        self.backend = backend
        self.ops: LayerOps = TORCH_OPS

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = self.ops.split_rotate_qkv(qkv, cos_sin, self.num_heads, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.even(
            config.hidden_size, (self.intermediate, self.intermediate), False, tp
        )
        self.down_proj = RowParallelLinear(self.intermediate, config.hidden_size, tp)
        self.ops: LayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))

    def hand_off_bf16(self, on: bool) -> None:
        """With bf16 CPU GEMMs and a SiLU-and-mul that reads and writes bf16: gate/up's product goes into it as bf16
        (rounded once, as oneDNN's bf16 GEMM returns it; half the bytes of fp32) and its bf16 output is the down
        projection's input, which is rounded to bf16 either way. kernels/cpu/decode_step.cpp does the same."""
        forms = self.gate_up_proj.cpu_forms
        if forms is not None:
            forms.bf16_out = on


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, qkv_bias: bool, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, qkv_bias, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral (same graph) and Qwen2 (Q/K/V biases)."""

    qkv_bias = False

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, max_positions: int, tp: TensorParallel = SINGLE
    ) -> None:
        """`tp`: the shard this process holds (rank of size); the default is the whole model."""
        super().__init__()
        check_heads(config.num_attention_heads, config.num_key_value_heads, tp.size)
        self.config = config
        self.tp = tp
        self.embed_tokens: nn.Module = (
            Embedding(config.vocab_size, config.hidden_size)
            if tp.size == 1
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, self.qkv_bias, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, backend.head_dim, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            Linear(config.hidden_size, config.vocab_size, bias=False)
            if tp.size == 1
            else ParallelLMHead(config.hidden_size, config.vocab_size, tp)
        )
        if self.tie_word_embeddings:  # one parameter, the embedding's; the LM head's method packs its own forms
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final hidden states `[num_tokens, hidden]` (logits are computed only where needed)."""
        h = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer.input_layernorm(h, residual)
            h = layer.self_attn(x, cos_sin, kv_cache, meta)
            x, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(x)
        h, _ = self.norm(h, residual)
        return h

    def embed_from_lm_head_codes(self) -> bool:
        """A tied embedding whose LM head keeps the table as block codes (layers/coded_embedding.py) or as int8 codes
        per row (layers/int8_embedding.py) reads its rows from those codes and drops its float32 table; after the
        linears' weights are processed."""
        forms = self.lm_head.cpu_forms
        if not self.tie_word_embeddings or forms is None or forms.plain is not None:
            return False
        if not isinstance(self.embed_tokens, Embedding) or self.embed_tokens.weight.dtype != torch.float32:
            return False
        if forms.int8 is not None:
            self.embed_tokens = Int8Embedding(forms.int8.codes, forms.int8.scale)
        elif forms.coded is not None:
            self.embed_tokens = CodedEmbedding(forms.coded, self.config.vocab_size, self.config.hidden_size)
        else:
            return False
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of `hidden`'s rows; under tensor parallelism on rank 0 only (None on the others)."""
        if isinstance(self.lm_head, ParallelLMHead):
            return self.lm_head.logits(hidden)
        return self.lm_head(hidden).float()

    def use_layer_ops(self, ops: LayerOps) -> None:
        """RMSNorm (+ residual add), rotary and SiLU-and-mul run as `ops` (layer_ops.py: eager torch, the fused native
        CPU ops or the fused Triton kernels), the model runner's choice for its device and attention backend. (A
        decode-only step in one native call is a step function: model/native_decode.py.)"""
        forms = self.layers[0].mlp.gate_up_proj.cpu_forms
        bf16 = forms is not None and forms.bf16
        if bf16 and self.tp.size == 1:  # NOTE: not under TP, where the ranks' products are summed in fp32
            ops = ops.for_bf16_gemms(forms.rows.coded_m)
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.ops = ops
            if isinstance(module, MLP):
                module.hand_off_bf16(ops.silu_reads_bf16)
            # the bf16 products that go into the rotary or the next norm as they are
            products = (module.qkv_proj, module.o_proj) if isinstance(module, Attention) else ()
            if isinstance(module, MLP):
                products = (module.down_proj,)
            for proj in products:
                if proj.cpu_forms is not None:
                    proj.cpu_forms.bf16_out = ops.reads_bf16_products
        self.norm.ops = ops.fp32_out()

    # checkpoint projection -> (fused layer, shard): the fused layer's `weight_loader` stacks the shards
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | BlockCodes]]) -> None:
        """Maps HF names onto the fused layout; fails loudly on a missing or unexpected tensor. A tensor given as its
        GGUF codes is loaded as its values, and a linear also keeps the codes for its method (layers/gguf_codes.py)."""
        params = dict(self.named_parameters())  # a tied LM head's weight is listed once, as the embedding's
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, item in weights:
            tensor = item.values() if isinstance(item, BlockCodes) else item
            # NOTE: a tensor-parallel shard is cut from the values (parallel_linear.py): K-quant codes are not sliced.
            codes = item if isinstance(item, BlockCodes) and self.tp.size == 1 else None
            name = hf_name.removeprefix("model.")
            if codes is not None and name == "embed_tokens.weight" and self.tie_word_embeddings:
                self.lm_head.block_codes = [codes]
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in self.packed_modules:
                fused_name, shard = self.packed_modules[parts[-2]]
                target = ".".join([*parts[:-2], fused_name, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            owner = self.get_submodule(target.rpartition(".")[0])
            if isinstance(owner, Linear | VocabParallelEmbedding):  # this rank's slice of the tensor
                if isinstance(owner, Linear):
                    owner.weight_loader(params[target], tensor, shard, codes)
                else:
                    owner.weight_loader(params[target], tensor, shard)
            else:
                params[target].copy_(tensor)
            loaded.add((target, shard))
        missing = sorted(f"{name}#{shard}" for name, shard in self._expected_loads(params) - loaded)
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name in params:
            owner = self.get_submodule(name.rpartition(".")[0])
            if isinstance(owner, Linear) and owner.num_shards > 1:
                expected |= {(name, shard) for shard in range(owner.num_shards)}
            else:
                expected.add((name, None))
        return expected


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
