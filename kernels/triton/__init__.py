"""Triton kernels: GEMMs on int8-coded weights, paged KV-cache writes, paged decode/prefill attention and the fused
elementwise ops of the Llama block.
Compiled on CUDA; run by Triton's interpreter on CPU tensors (see `kernels.triton_mode`).

Every kernel has a readable torch twin in `kernels.reference`, which the tests compare against.
"""

from __future__ import annotations

from kernels.triton_mode import configure_triton_interpret

# NOTE: before the first `import triton` below (the submodules'), so the kernels are decorated in the right mode.
configure_triton_interpret()

from kernels.triton.coded_matmul import coded_matmul
from kernels.triton.decode_attention import choose_num_splits, decode_attention, plan_decode
from kernels.triton.fused import fused_add_rms_norm, rms_norm, rotary_embedding_neox, silu_and_mul
from kernels.triton.prefill_attention import prefill_attention, prefill_num_tiles, prefill_tile_map
from kernels.triton.store_kv import store_kv

__all__ = [
    "choose_num_splits",
    "coded_matmul",
    "decode_attention",
    "fused_add_rms_norm",
    "plan_decode",
    "prefill_attention",
    "prefill_num_tiles",
    "prefill_tile_map",
    "rms_norm",
    "rotary_embedding_neox",
    "silu_and_mul",
    "store_kv",
]
