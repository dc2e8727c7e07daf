"""A GGUF file's tensors as the float32 tensors transformers' GGUF loader makes of them, under their HF names.

The cached model directory of a GGUF file holds its config and tokenizer and a link to the file (model_files.py);
the weights are decoded from the file at every load. A cold start reads the 98 MB file instead of 514 MB of float32
safetensors, and the first start converts no weights.

NOTE: bit for bit what transformers makes (tests/test_gguf_weights.py compares every tensor of SmolLM2):
- the block formats are decoded with the same float32 operations as gguf-py's numpy code (`d * q + m`, each
  rounded once; f16 scales widened exactly), in torch, on every core (K-quants: gguf_kquants.py); other types go
  through gguf-py itself;
- llama.cpp stores Llama's Q and K rows permuted for its rotary kernel; transformers undoes that permutation
  (`LlamaTensorProcessor`), and so does `_unpermute_rows`. Qwen2 is stored as is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, dequantize

from engine_core.checkpoint.gguf_file import ARCHITECTURES, GgufTensor, check_architecture, read_index
from engine_core.model.gguf_kquants import KQUANTS, unpack_kquant
from engine_core.model.gguf_legacy_codes import LEGACY, unpack_legacy
from engine_core.model.layers.block_codes import BlockCodes

Q = GGMLQuantizationType
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# NOTE: llama.cpp's precomputed RoPE factors (Llama 3): transformers' model has no parameter for them, so its loader
# drops them, and so does this one (the RoPE scaling is the config's).
_IGNORED = {"rope_freqs.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for a tensor transformers drops."""
    if gguf_name in _IGNORED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama-family model")
    return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"


def iter_gguf_weights(
    path: str | Path, num_heads: int, num_kv_heads: int, with_codes: bool = False, legacy_codes: bool = False
) -> Iterator[tuple[str, torch.Tensor | BlockCodes]]:
    """Yields (HF name, float32 tensor) for every tensor of the file, decoded and unpermuted as transformers does;
    with `with_codes`, a K-quant matrix as its `BlockCodes` (whose `values()` is that tensor), for the linears that
    compute from codes (layers/gguf_codes.py); with `legacy_codes` too, a Q8_0 ... Q5_1 matrix as well
    (gguf_legacy_codes.py; the CUDA linears, layers/cuda_codes.py)."""
    index = read_index(path)
    check_architecture(index)
    permuted = ARCHITECTURES[index.architecture]
    # NOTE: one sequential read of the whole file (98 MB for SmolLM2), not a read per tensor.
    data = torch.empty(index.size, dtype=torch.uint8)
    with index.path.open("rb") as f:
        if f.readinto(memoryview(data.numpy())) != index.size:
            raise ValueError(f"{index.path}: short read")
    for tensor in index.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        raw = data[tensor.offset : tensor.offset + tensor.nbytes]
        heads = num_heads if ".attn_q." in tensor.name else num_kv_heads if ".attn_k." in tensor.name else 0
        legacy = with_codes and legacy_codes and tensor.kind in LEGACY
        if with_codes and (tensor.kind in KQUANTS or legacy) and len(tensor.shape) == 2:
            codes = (unpack_legacy if legacy else unpack_kquant)(tensor.kind, raw, tensor.shape)
            if permuted and heads:
                codes = codes.rows(_unpermute_rows(torch.arange(tensor.shape[0]), heads))
            yield name, codes
            continue
        weight = decode(tensor, raw)
        if permuted and heads:
            weight = _unpermute_rows(weight, heads)
        yield name, weight


def decode(tensor: GgufTensor, raw: torch.Tensor) -> torch.Tensor:
    """The tensor's float32 values from its bytes `raw` (uint8)."""
    if tensor.kind == Q.F32:
        out = raw.view(torch.float32)
    elif tensor.kind == Q.F16:
        out = raw.view(torch.float16).float()
    elif tensor.kind == Q.BF16:
        out = raw.view(torch.bfloat16).float()
    elif tensor.kind == Q.Q8_0:  # blocks of 34 bytes: f16 d, int8 q[32]; x = q * d
        blocks = raw.view(-1, 34)
        out = blocks[:, 2:].view(torch.int8).float() * _f16(blocks[:, :2])
    elif tensor.kind in (Q.Q4_0, Q.Q4_1):
        # Q4_0: blocks of 18 bytes: f16 d, 16 bytes of nibbles; x = d * (q - 8).
        # Q4_1: blocks of 20 bytes: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m.
        # The low nibbles are a block's first 16 values, the high ones its last 16.
        head = 2 if tensor.kind == Q.Q4_0 else 4
        blocks = raw.view(-1, head + 16)
        nibbles = blocks[:, head:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1)
        if tensor.kind == Q.Q4_0:
            out = _f16(blocks[:, :2]) * (q.to(torch.int8) - 8).float()
        else:
            out = _f16(blocks[:, :2]) * q.float() + _f16(blocks[:, 2:4])
    elif tensor.kind in KQUANTS:
        out = unpack_kquant(tensor.kind, raw, tensor.shape).values()
    else:
        # NOTE: gguf-py's own decoding (numpy, one core): exact by definition for every other format.
        try:
            out = torch.from_numpy(dequantize(raw.numpy(), tensor.kind).copy())
        except NotImplementedError:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is of type {tensor.kind.name}, which the engine cannot decode"
            ) from None
    return out.reshape(tensor.shape)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """`[B, 2]` uint8 -> `[B, 1]` float32 (little-endian f16, widened exactly)."""
    return two_bytes.contiguous().view(torch.float16).float()


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's permutation of a Q or K projection's rows (transformers' `_reverse_permute_weights`): per
    head, rows stored as (half, pair) go back to (pair, half)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
