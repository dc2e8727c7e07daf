"""The native bf16 GEMM (kernels/cpu/bf16_linear.cpp): bf16 x and W as `bf16_pack` pair panels, fp32 accumulation,
the product in float32 or bf16, against a float64 reference over the same bf16 inputs.

Tolerance: the products of two bf16 values are exact in fp32, so the only error is the fp32 accumulation's rounding,
at most K * 2^-24 relative to the sum of |products| (stated bound: 2^-24 * (K + 1) * sum |x_k w_k| + bias's ulp); a
bf16 output adds one rounding to nearest even: at most half a bf16 ulp (2^-8 relative) of the fp32 value.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available() or not cpu_kernels.bf16_linear_native(),
    reason="no native CPU kernels with AVX-512 BF16",
)


def _case(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g)
    return x, w, b


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0.0 if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T + (0.0 if b is None else b.double().abs())
    bound = 2.0**-24 * (x.shape[1] + 2) * magnitude
    if got.dtype == torch.bfloat16:  # the fp32 sum rounded once more, to nearest even
        bound = bound + 2.0**-8 * (exact.abs() + bound)
    err = (got.double() - exact).abs()
    worst = (err - bound).max().item()
    assert worst <= 0.0, f"over the bound by {worst} (max error {err.max().item()})"


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 1, 1),
        (3, 5, 7),  # K odd, N below one panel
        (2, 31, 33),  # K below one pair block, N one column past a panel
        (13, 576, 960),  # SmolLM2's qkv
        (12, 577, 70),  # K odd, N not a multiple of 32
        (25, 1536, 576),  # down
        (64, 100, 3072),  # gate_up's width, rows past several register blocks
        (300, 64, 40),
        (3000, 96, 50),  # prefill-sized rows, partial panel
    ],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32-out", "bf16-out"])
def test_bf16_linear_is_the_fp32_sum_of_bf16_products(
    m: int, k: int, n: int, bias: bool, out_dtype: torch.dtype
) -> None:
    x, w, b = _case(m, k, n, seed=m * 7 + k + n)
    packed = cpu_kernels.bf16_pack(w)
    assert packed.shape == (-(-n // 32), -(-k // 2), 32, 2) and packed.dtype == torch.bfloat16
    got = cpu_kernels.bf16_linear(x, packed, n, b if bias else None, out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    _check(got, x, w, b if bias else None)


def test_strided_rows_thread_counts_and_the_fp32_product_rounded_agree() -> None:
    """x as a view with a row stride (attention's output in a wider buffer); the same bits on 1 and 2 threads (each
    output is summed by one thread in K's order); the bf16 product is the fp32 one rounded (torch's rounding)."""
    x, w, b = _case(70, 578, 130, seed=3)
    wide = torch.zeros(70, 700, dtype=torch.bfloat16)
    wide[:, 5 : 5 + 578] = x
    view = wide[:, 5 : 5 + 578]
    packed = cpu_kernels.bf16_pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.bf16_linear(view, packed, 130, b, torch.float32)
        torch.set_num_threads(2)
        two = cpu_kernels.bf16_linear(view, packed, 130, b, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one, cpu_kernels.bf16_linear(x, packed, 130, b, torch.float32))
    assert torch.equal(cpu_kernels.bf16_linear(x, packed, 130, b, torch.bfloat16), one.bfloat16())
    _check(one, x, w, b)


def test_the_panels_hold_the_weight_in_pairs_zero_padded() -> None:
    w = torch.arange(1, 35 * 5 + 1, dtype=torch.float32).view(35, 5).bfloat16()
    packed = cpu_kernels.bf16_pack(w)
    assert packed.shape == (2, 3, 32, 2)
    assert torch.equal(packed[0, 1, 4], w[4, 2:4])  # column 4, the pair (k=2, k=3)
    assert torch.equal(packed[1, 2, 2], torch.stack([w[34, 4], torch.tensor(0.0, dtype=torch.bfloat16)]))  # odd K
    assert not packed[1, :, 3:].any()  # columns past N


def test_bad_inputs_are_refused_with_the_argument_named() -> None:
    x, w, _ = _case(4, 64, 40, seed=1)
    packed = cpu_kernels.bf16_pack(w)
    with pytest.raises(RuntimeError, match="x and the packed weight must be bf16"):
        cpu_kernels.bf16_linear(x.float(), packed, 40, None, torch.float32)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_kernels.bf16_linear(x[:, :62], packed, 40, None, torch.float32)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.bf16_linear(x, packed, 40, torch.zeros(39), torch.float32)
    with pytest.raises(RuntimeError, match="weight must be bf16"):
        cpu_kernels.bf16_pack(w.float())
