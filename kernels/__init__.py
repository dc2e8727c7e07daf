"""Triton kernels for Pagoda: paged KV-cache writes, paged decode/prefill attention and small fused helpers.

Every kernel has a readable torch twin in `kernels.reference`, which the tests compare against.
"""

from __future__ import annotations

import os

import torch

# NOTE: `triton.jit` decides at *decoration* time (i.e. when our kernel modules are imported) whether to build a
# compiled or an interpreted kernel, by reading TRITON_INTERPRET. Without a CUDA device the interpreter is the only
# way these kernels can run at all (on CPU tensors), so we turn it on here, before any submodule imports triton.
# An explicit TRITON_INTERPRET setting (either way) is respected.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

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
