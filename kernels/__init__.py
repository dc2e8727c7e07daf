"""Triton kernels for Pagoda: paged KV-cache writes, paged decode/prefill attention and small fused helpers.

Every kernel has a readable torch twin in `kernels.reference`, which the tests compare against.
"""

from __future__ import annotations

from kernels.triton_mode import configure_triton_interpret

# NOTE: before any submodule imports triton (see configure_triton_interpret).
configure_triton_interpret()

from kernels.decode_attention import choose_num_splits, decode_attention
from kernels.fused import fused_add_rms_norm, rms_norm, rotary_embedding_neox, silu_and_mul
from kernels.prefill_attention import prefill_attention
from kernels.store_kv import store_kv

__all__ = [
    "choose_num_splits",
    "decode_attention",
    "fused_add_rms_norm",
    "prefill_attention",
    "rms_norm",
    "rotary_embedding_neox",
    "silu_and_mul",
    "store_kv",
]
