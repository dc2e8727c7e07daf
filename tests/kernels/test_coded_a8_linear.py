"""`coded_a8_linear` (kernels/cpu/coded_a8_linear.cpp, quantization="gguf_a8"): 4-bit GGUF codes times activations
quantized to 8 bits per 32-k block, in integer dot products. Checked against a float64 replay of the same arithmetic
(kernels/reference.py), against the exact product within the bound that 8-bit activations allow, and for the same
bits whatever the thread count or row tiling."""

from __future__ import annotations

import pytest
import torch

from engine_core.model.layers.block_codes import BlockCodes
from kernels import cpu as cpu_kernels
from kernels.reference import ref_a8_quantize, ref_coded_a8_matmul, ref_gguf_decoded

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_a8_supported()), reason="no AVX2 + FMA native kernels here"
)


def q4_codes(n: int, k: int, seed: int, kind: str) -> BlockCodes:
    """Random 4-bit codes: Q4_1 (w = d * q + m), Q4_0 (m = -8 d) or Q4_K-like (d and m from sub-block scales)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = {
        "q4_1": -(torch.rand(n, k // 32, generator=g) * 0.1).half().float(),
        "q4_0": -8 * d,
        "q4_k": -(torch.randint(0, 64, (n, k // 32), generator=g).float() * 1.5e-3),
    }[kind]
    return BlockCodes(d, m, q, 32, 4)


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q4_k"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize(("n", "with_bias"), [(16, False), (50, True), (96, False)])
def test_matches_a_float64_replay_of_its_arithmetic(kind: str, rows: int, n: int, with_bias: bool) -> None:
    k = 160
    codes = q4_codes(n, k, rows + n, kind)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g) * 3
    x[0, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
    bias = torch.randn(n, generator=g) if with_bias else None
    got = cpu_kernels.coded_a8_linear(x, codes.records(), n, bias)
    want = ref_coded_a8_matmul(x, codes.q, codes.scales, codes.offsets, bias)
    # float32 accumulation over k / 32 blocks against float64: a few ulps of the largest terms
    scale = float((x.abs() @ codes.values().abs().T).max())
    assert (got.double() - want).abs().max() <= 1e-6 * scale


def test_the_error_against_the_exact_product_is_within_half_an_activation_step() -> None:
    """|x - d_a q_a| <= d_a / 2 per element, so each output is within sum_k d_a(k) / 2 |w_k| of x @ w: the only
    loss is the activations' rounding (the weights are the file's codes, exact)."""
    n, k = 64, 576
    codes = q4_codes(n, k, 3, "q4_1")
    w = codes.values()
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    x[:, 100] = 40.0  # an outlier: its block's step is coarse, the others' are not
    got = cpu_kernels.coded_a8_linear(x, codes.records(), n, None).double()
    exact = x.double() @ w.double().T
    _, d, _ = ref_a8_quantize(x)
    bound = (d.double().repeat_interleave(32, dim=1) / 2) @ w.double().abs().T
    assert ((got - exact).abs() <= bound * (1 + 1e-5) + 1e-5).all()
    assert (got - exact).abs().max() > 0  # another computation than float32's, really


def test_reads_the_records_that_coded_pack_finds_in_gguf_weights() -> None:
    """The records are the exact path's (resident once): Q4_1 weights as the loader decodes them."""
    g = torch.Generator().manual_seed(5)
    w = ref_gguf_decoded(torch.randn(40, 128, generator=g) * 0.05, "q4_1")
    records = cpu_kernels.coded_pack(w)
    assert records is not None and cpu_kernels.coded_a8_reads(records)
    x = torch.randn(6, 128, generator=g)
    got = cpu_kernels.coded_a8_linear(x, records, 40, None)
    exact = x @ w.T
    assert torch.allclose(got, exact, atol=0.02 * float(exact.abs().max()))
    eight = cpu_kernels.coded_pack(ref_gguf_decoded(torch.randn(16, 64, generator=g), "q8_0"))
    assert eight is not None and not cpu_kernels.coded_a8_reads(eight)


@pytest.mark.parametrize("rows", [5, 130])
def test_same_bits_for_any_thread_count_and_strided_rows(rows: int) -> None:
    n, k = 200, 192
    codes = q4_codes(n, k, 6, "q4_1")
    records = codes.records()
    wide = torch.randn(rows, k + 40, generator=torch.Generator().manual_seed(7))
    x = wide[:, 8 : 8 + k]  # rows with a stride, as a view into a fused projection's output
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_kernels.coded_a8_linear(x, records, n, None))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs)
    # each row alone: the same bits as within the batch (rows are quantized and tiled independently)
    assert torch.equal(cpu_kernels.coded_a8_linear(x[2:3].contiguous(), records, n, None), outs[0][2:3])


def test_a_non_finite_row_gives_non_finite_outputs_and_leaves_the_other_rows_alone() -> None:
    n, k = 32, 96
    codes = q4_codes(n, k, 8, "q4_1")
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(9))
    clean = cpu_kernels.coded_a8_linear(x, codes.records(), n, None)
    bad = x.clone()
    bad[0, 5], bad[1, 70] = float("inf"), float("nan")
    got = cpu_kernels.coded_a8_linear(bad, codes.records(), n, None)
    assert not torch.isfinite(got[:2]).any()
    assert torch.equal(got[2:], clean[2:])


def test_rejects_records_it_does_not_read() -> None:
    x = torch.randn(2, 64)
    eight = torch.zeros(1, 2, 640, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="coded_a8_linear: records must be coded_linear's 4-bit records"):
        cpu_kernels.coded_a8_linear(x, eight, 16, None)
    with pytest.raises(RuntimeError, match=r"coded_a8_linear: records must be \[ceil\(N/16\), K/32, R\]"):
        cpu_kernels.coded_a8_linear(x, torch.zeros(1, 3, 384, dtype=torch.uint8), 16, None)
    with pytest.raises(RuntimeError, match="coded_a8_linear: bias must be"):
        cpu_kernels.coded_a8_linear(x, torch.zeros(1, 2, 384, dtype=torch.uint8), 16, torch.zeros(3))
