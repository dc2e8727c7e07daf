"""A step function for decode-only steps on CPU: every layer of the model in one native call.

The model has one forward (the layer loop); how a step runs is the model runner's choice among step functions
(`worker/step_functions.py`). This one chains the same ops in C++ (kernels/cpu/decode_step.cpp) over the same
layer objects: each projection's weight forms and row thresholds are its `Linear`'s (`CpuWeightForms`), so its
outputs match the layer loop's and a weight format is added in one place. It serves only steps where every row is a
decode.

An all-int8 model (weight-only at the step's rows) can also run its final norm and LM head inside the native call
(`with_head`: kernels/cpu/decode_int8.cpp), and there pick each row's greedy token without writing the logits; the
runner chooses that per step (worker/head_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.model.layers.cpu_forms import CpuWeightForms
from engine_core.model.layers.cpu_gemm_rows import NEVER
from engine_core.model.layers.int8_embedding import Int8Embedding
from engine_core.model.layers.linear import Linear
from engine_core.model.llama import Embedding, LlamaForCausalLM
from kernels import cpu as cpu_kernels


@dataclass
class HeadOutput:
    """What `NativeDecodeStep.with_head` returns: the logits [rows, vocab], or with `greedy` each row's first index of
    its largest logit, FAILED_TOKEN where that maximum is not finite (the sampler's greedy rule)."""

    logits: torch.Tensor | None
    tokens: torch.Tensor | None


class NativeDecodeStep:
    """Needs the model's linears processed by a CPU method (model/layers/cpu_float32.py, or cpu_int8.py) and the
    `cpu` attention backend's cache layout."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        layers = model.layers
        attn = [layer.self_attn for layer in layers]
        mlp = [layer.mlp for layer in layers]
        projections = [
            p for a, m in zip(attn, mlp, strict=True) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        ]
        forms = [_cpu_forms(p) for p in projections]
        rows = forms[0].rows
        if any(f.rows != rows for f in forms):
            raise ValueError("the native decode step needs one row dispatch for every projection")
        w8a8_ms = {f.int8.w8a8_m for f in forms if f.int8 is not None}
        if len(w8a8_ms) > 1:
            raise ValueError("the native decode step needs one W8A8 threshold for every int8 projection")
        w8a8_m = w8a8_ms.pop() if w8a8_ms else NEVER
        self.weights = cpu_kernels.DecodeLayerWeights(
            norms=[
                w for layer in layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            ],
            out_features=[f.out_features for f in forms],
            plain=[f.plain for f in forms],
            panels=[f.panels for f in forms],
            coded=[f.coded for f in forms],
            onednn=[f.onednn for f in forms],
            int8_codes=[None if f.int8 is None else f.int8.codes for f in forms],
            int8_scales=[None if f.int8 is None else f.int8.scale for f in forms],
            qkv_biases=[a.qkv_proj.bias for a in attn] if model.qkv_bias else [],
            num_heads=attn[0].num_heads,
            num_kv_heads=attn[0].num_kv_heads,
            head_dim=attn[0].head_dim,
            eps=layers[0].input_layernorm.eps,
            scale=attn[0].backend.scale,
            coded_m=rows.coded_m,
            onednn_m=rows.onednn_m,
            large_m=rows.large_m,
            w8a8_m=w8a8_m,
            a8_m=rows.a8_m,
        )
        self.head = _int8_head(model, forms)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        model = self.model
        h = model.embed_tokens(input_ids)
        cos, sin = model.rotary.lookup(positions, h.dtype)
        t = h.shape[0]
        h, residual = cpu_kernels.decode_layers(
            h,
            cos.view(t, -1),
            sin.view(t, -1),
            kv_caches,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.weights,
        )
        h, _ = model.norm(h, residual)
        return h

    def fuses_head(self, rows: int) -> bool:
        """Whether a decode-only step of `rows` rows can run the LM head inside the native call (`with_head`)."""
        return self.head is not None and 0 < rows < self.weights.w8a8_m

    def with_head(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        greedy: bool,
    ) -> HeadOutput:
        """The step (where `fuses_head`) through the final norm and the LM head: the logits of every row, bitwise
        `model.compute_logits(self(...))`'s; with `greedy` only each row's greedy token."""
        assert self.head is not None
        model = self.model
        # NOTE: the embedding and rotary rows are gathered in the call (from a float32 table or the head's int8 codes)
        gather = _gather_table(model.embed_tokens)
        assert gather is not None, "with_head needs an embedding it can gather from (_int8_head checked it)"
        table, table_scale = gather
        first, tokens = cpu_kernels.decode_int8_head(
            input_ids,
            positions,
            table,
            table_scale,
            model.rotary.cos,
            model.rotary.sin,
            kv_caches,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.weights,
            self.head,
            greedy,
        )
        return HeadOutput(None, tokens) if greedy else HeadOutput(first, None)


def _int8_head(model: LlamaForCausalLM, forms: list[CpuWeightForms]) -> cpu_kernels.Int8Head | None:
    """The LM head for `decode_int8_head`, where every projection and the head are int8 codes without a bias on the
    head, the final norm is the layers' (its eps), the embedding a float32 table or int8 codes (a tied table read
    from the head's), and the build runs the int8 step; else None."""
    head = model.lm_head
    head_forms = head.cpu_forms if isinstance(head, Linear) and head.bias is None else None
    if head_forms is None or head_forms.int8 is None or any(f.int8 is None for f in forms):
        return None
    if model.norm.eps != model.layers[0].input_layernorm.eps or _gather_table(model.embed_tokens) is None:
        return None
    max_k = max(f.int8.codes.shape[1] for f in [*forms, head_forms] if f.int8 is not None)
    if not cpu_kernels.decode_int8_supported(max_k):
        return None
    return cpu_kernels.Int8Head(model.norm.weight.detach(), head_forms.int8.codes, head_forms.int8.scale)


def _gather_table(embedding: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(table, per-row scales or None) that `decode_int8_head` gathers the step's rows from: a float32 table, or
    int8 codes with their scales; None for any other embedding."""
    if isinstance(embedding, Int8Embedding):
        return embedding.codes, embedding.scale
    if isinstance(embedding, Embedding) and embedding.weight.dtype == torch.float32:
        return embedding.weight, None
    return None


def _cpu_forms(layer: Linear) -> CpuWeightForms:
    if layer.cpu_forms is None:
        raise ValueError(f"the native decode step needs CPU weight forms; this linear is {layer.method.name}")
    return layer.cpu_forms
