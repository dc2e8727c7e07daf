"""No recompiles mid-generation: as one sequence grows to thousands of tokens, the decode (and prefill) launches keep
hitting the same compiled variants.

Triton compiles one variant per *specialization key*: the constexpr values, the argument dtypes, and for plain
integers whether they equal 1 or are divisible by 16 (unless listed in `do_not_specialize`). The key is computed
here with triton's own binder for an H100 target (`create_function_from_signature`, what `JITFunction.run` calls),
from the arguments the real launch passes (captured by the kernels' `pre_run_hooks`), so this runs on CPU too.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.triton import choose_num_splits, decode_attention, prefill_attention
from tests.kernels.conftest import DEVICE, make_paged_cache

coded_mod = importlib.import_module("kernels.triton.coded_matmul")
decode_mod = importlib.import_module("kernels.triton.decode_attention")
prefill_mod = importlib.import_module("kernels.triton.prefill_attention")


class _Keys:
    """Records the triton specialization key of every launch of one kernel (the real launch still runs)."""

    def __init__(self, kernel: object) -> None:
        try:
            from triton.backends.compiler import GPUTarget
            from triton.compiler import make_backend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            backend = make_backend(GPUTarget("cuda", 90, 32))
        except Exception as e:  # a triton build without the NVIDIA backend, or another version's internals
            pytest.skip(f"triton's binder or CUDA backend is unavailable here: {e}")
        # The raw Python function and the decorator's arguments, from an interpreted or a compiled kernel alike.
        if isinstance(kernel, JITFunction):
            kwargs = {
                "do_not_specialize": kernel.do_not_specialize,
                "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
            }
        else:
            kwargs = kernel.kwargs  # type: ignore[attr-defined]
        jit = JITFunction(kernel.fn, **kwargs)  # type: ignore[attr-defined]
        self._binder = create_function_from_signature(jit.signature, jit.params, backend)
        self.keys: set[str] = set()
        self._kernel = kernel

    def __enter__(self) -> _Keys:
        self._kernel.pre_run_hooks.append(self._record)  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        self._kernel.pre_run_hooks.remove(self._record)  # type: ignore[attr-defined]

    def _record(self, *args: object, **kwargs: object) -> None:
        # NOTE: triton 3.6 passes `debug` to the hooks too; 3.9 does not. The binder takes it once, here.
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup", "debug")}
        _, specialization, _ = self._binder(*args, **kwargs, debug=False)
        self.keys.add(repr(specialization))


def _decode_growing(lengths: list[int], batch: int, dtype: torch.dtype) -> tuple[set[str], set[str], set[int]]:
    """Decode steps of `batch` sequences whose context grows through `lengths`, with block tables exactly as wide
    as the step's longest context needs (as the runner builds them)."""
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16  # SmolLM2-135M's attention
    kv_cache, tables = make_paged_cache([max(lengths)] * batch, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(batch, num_kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    splits_seen: set[int] = set()
    with _Keys(decode_mod._decode_kernel) as dk, _Keys(decode_mod._decode_reduce_kernel) as rk:
        for n in lengths:
            width = -(-n // block_size)
            lens = torch.full((batch,), n, dtype=torch.int32, device=DEVICE)
            splits_seen.add(choose_num_splits(batch, num_kv_heads, n))
            decode_attention(q, kv_cache[0], kv_cache[1], tables[:, :width].contiguous(), lens, 0.125, n)
    return dk.keys, rk.keys, splits_seen


def test_growing_sequence_compiles_at_most_two_decode_variants() -> None:
    # Lengths around every value class triton distinguishes (1, multiples of 16, others) and around the split
    # heuristic's steps: 1 split below 512 tokens, then 2, 3, ... splits.
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 511, 512, 513, 767, 768, 1024, 1025, 1280, 1536, 1792, 2048]
    decode_keys, reduce_keys, splits = _decode_growing(lengths, 1, torch.bfloat16)
    assert len(splits) >= 5, splits  # the split count really changed along the way ...
    assert len(decode_keys) == 2, decode_keys  # ... yet: one variant without splitting, one with
    assert len(reduce_keys) == 1, reduce_keys


def test_fixed_split_count_for_any_length_is_one_variant() -> None:
    """What a CUDA graph does: one split count frozen at capture, correct for every length."""
    num_kv_heads, group, head_dim = 2, 4, 64
    lengths = [0, 1, 17, 300, 700]
    kv_cache, tables = make_paged_cache(lengths, 16, num_kv_heads, head_dim, torch.float32)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    from kernels.reference import ref_decode_attention

    with _Keys(decode_mod._decode_kernel) as dk:
        for splits in (4, 8):
            out = decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, 0.125, 700, num_splits=splits)
            torch.testing.assert_close(out, ref_decode_attention(q, kv_cache[0], kv_cache[1], tables, lens, 0.125))
    assert len(dk.keys) == 1


def test_prefill_chunks_of_a_growing_context_share_one_variant() -> None:
    num_kv_heads, group, head_dim, block_size = 3, 3, 64, 16
    contexts = [0, 16, 33, 64, 130]
    chunk = 16
    kv_cache, tables = make_paged_cache([contexts[-1] + chunk], block_size, num_kv_heads, head_dim, torch.bfloat16)
    with _Keys(prefill_mod._prefill_kernel) as pk:
        for ctx in contexts:
            total = ctx + chunk
            width = -(-total // block_size)
            q = torch.randn(chunk, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device=DEVICE)
            i32 = {"dtype": torch.int32, "device": DEVICE}
            prefill_attention(
                q,
                kv_cache[0],
                kv_cache[1],
                tables[:, :width].contiguous(),
                torch.tensor([total], **i32),
                torch.tensor([0, chunk], **i32),
                0.125,
                chunk,
            )
    assert len(pk.keys) == 1, pk.keys


@pytest.mark.parametrize("field", ["block_n", "block_m"])
@pytest.mark.parametrize("value", [8, 24, 48])
def test_tile_sizes_must_be_powers_of_two_at_least_16(field: str, value: int) -> None:
    kv_cache, tables = make_paged_cache([5], 16, 1, 64, torch.float32)
    q = torch.randn(5, 2, 64, device=DEVICE)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    with pytest.raises(ValueError, match=f"{field} must be a power of two >= 16, got {value}"):
        if field == "block_n":
            decode_attention(q[:1], kv_cache[0], kv_cache[1], tables, torch.tensor([5], **i32), 0.1, 5, block_n=value)
        else:
            prefill_attention(
                q,
                kv_cache[0],
                kv_cache[1],
                tables,
                torch.tensor([5], **i32),
                torch.tensor([0, 5], **i32),
                0.1,
                5,
                block_m=value,
            )


def test_coded_matmul_compiles_one_variant_per_regime_whatever_the_row_count() -> None:
    """The decode graphs' buckets (1 ... 16 rows) and prefill's row counts each share a layer's variant."""
    k, n = 256, 48
    codes = torch.randint(0, 16, (n, k), dtype=torch.int8, device=DEVICE)
    scales, offsets = torch.rand(n, k // 32, device=DEVICE), torch.rand(n, k // 32, device=DEVICE)
    with _Keys(coded_mod._coded_matmul_kernel) as keys:
        for m in (1, 2, 3, 8, 16):
            coded_mod.coded_matmul(torch.randn(m, k, device=DEVICE), codes, scales, offsets, 32, split=2)
        decode = set(keys.keys)
        for m in (17, 32, 33, 64):
            coded_mod.coded_matmul(torch.randn(m, k, device=DEVICE), codes, scales, offsets, 32)
    assert len(decode) == 1, decode
    assert len(keys.keys) == 2, keys.keys
