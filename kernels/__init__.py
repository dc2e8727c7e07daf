"""Pagoda's kernels, in two independent packages:

- `kernels.triton`: the Triton kernels of the `triton` attention backend and the model's fused CUDA ops (paged K/V
  writes, paged decode/prefill attention, RMSNorm + residual, rotary, SiLU-and-mul). Compiled on a CUDA device,
  run by Triton's interpreter on CPU tensors otherwise (`kernels.triton_mode` decides which, once).
- `kernels.cpu`: native C++ ops for the CPU fast path. It imports no Triton.

`kernels.reference` holds a readable torch twin of every Triton kernel, which the tests compare against.

NOTE: this file imports nothing, so that `from kernels import cpu` pulls in neither Triton nor its CUDA toolchain.
"""
