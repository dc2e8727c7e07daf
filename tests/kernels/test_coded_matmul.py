"""The coded GEMM (kernels/triton/coded_matmul.py) against `ref_coded_matmul`: every weight layout the CUDA linears
keep (per output channel; groups of 32 with and without offsets; groups of 16), both regimes (decode M <= 16 with a
K split, prefill), K and N that are not multiples of the tiles.

The codes and scales are drawn as GGUF's are (f16 scales, small integer codes), so each decoded weight is exact in
fp32 and the fp32 kernel differs from the reference by summation order alone."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import ref_coded_matmul
from kernels.triton import coded_matmul
from kernels.triton.coded_matmul import DECODE_ROWS, pack_nibbles, plan_coded_matmul
from tests.kernels.conftest import DEVICE, DTYPES, INTERPRETED, assert_close

# (group, offsets, code range): per channel int8; Q4_1-like (0..15, offsets); Q8_0-like; Q6_K-like (16 k, -32..31)
LAYOUTS = [
    pytest.param(0, False, (-127, 127), False, id="per-channel"),
    pytest.param(32, True, (0, 15), False, id="g32-offsets"),
    pytest.param(32, True, (0, 15), True, id="g32-offsets-packed"),  # Q4_1 / Q4_K as the CUDA linears keep them
    pytest.param(32, False, (-128, 127), False, id="g32"),
    pytest.param(16, False, (-32, 31), False, id="g16"),
]
# NOTE: interpreted, a few row counts that cross each regime's edges: 1 (batch-1 decode), 16 (the last decode row
# count), 17 (the first prefill one, a 64-row tile mostly masked), 70 (two prefill row tiles).
ROWS = [1, 5, 16, 17, 70] if INTERPRETED else [1, 2, 4, 8, 16, 17, 33, 64, 70, 128, 512]


def make_codes(
    n: int, k: int, group: int, offsets: bool, lo_hi: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    codes = torch.randint(lo_hi[0], lo_hi[1] + 1, (n, k), dtype=torch.int8)
    groups = (n,) if group == 0 else (n, k // group)
    scales = (torch.rand(groups) * 0.02 + 0.001).half().float()
    off = -(torch.rand(groups) * 0.1).half().float() if offsets else None
    return codes.to(DEVICE), scales.to(DEVICE), None if off is None else off.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "offsets", "lo_hi", "packed"), LAYOUTS)
@pytest.mark.parametrize("m", ROWS)
def test_coded_matmul_matches_reference(
    m: int, group: int, offsets: bool, lo_hi: tuple[int, int], packed: bool, dtype: torch.dtype
) -> None:
    # N: a 32-column tile and a masked one; K: 1.25 decode tiles, 2.5 prefill tiles (packed: 96 columns of bytes,
    # whose halves start on a group)
    n, k = 40, 192 if packed else 160
    codes, scales, off = make_codes(n, k, group, offsets, lo_hi)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    held = pack_nibbles(codes) if packed else codes
    y = coded_matmul(x, held, scales, off, group, bias, packed=packed)
    assert y.shape == (m, n) and y.dtype == dtype
    expected = ref_coded_matmul(x, codes, scales, off, group, bias)
    if dtype == torch.float32:
        assert_close("coded_matmul", y, expected, dtype)
        return
    # NOTE: bf16 / fp16: the weight tile and the output are rounded to the dtype (the interpreter truncates where a GPU
    # rounds to nearest), so the bound is 2^-7 of the terms' magnitudes, not of a sum that may cancel to near 0.
    w_abs = ref_coded_matmul(x.abs().float(), codes.abs(), scales.abs(), None if off is None else off.abs(), group)
    bound = (w_abs + bias.abs().float()) * 2**-7 + 1e-3
    err = (y.float() - expected.float()).abs()
    assert torch.isfinite(y).all() and (err <= bound).all(), (err - bound).max().item()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_decode_split_k_sums_every_range_once(split: int, packed: bool) -> None:
    """The K split's ranges cover K exactly once, whatever the split (3 does not divide the 5 tiles of K=640, nor
    the 3 tiles of its 320 packed columns)."""
    n, k = 24, 640
    codes, scales, off = make_codes(n, k, 32, True, (0, 15))
    x = torch.randn(3, k, device=DEVICE)
    held = pack_nibbles(codes) if packed else codes
    y = coded_matmul(x, held, scales, off, 32, split=split, packed=packed)
    assert_close("coded_matmul", y, ref_coded_matmul(x, codes, scales, off, 32), torch.float32)


def test_packing_keeps_every_code() -> None:
    codes = torch.randint(0, 16, (5, 64), dtype=torch.int8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 32)
    assert torch.equal(torch.cat([packed & 15, packed >> 4], dim=1).to(torch.int8), codes)


def test_empty_rows_and_bad_layouts_are_refused_by_name() -> None:
    codes, scales, _ = make_codes(8, 64, 32, False, (-8, 7))
    assert coded_matmul(torch.randn(0, 64, device=DEVICE), codes, scales, None, 32).shape == (0, 8)
    with pytest.raises(ValueError, match="group"):
        coded_matmul(torch.randn(1, 64, device=DEVICE), codes, scales, None, 24)
    with pytest.raises(ValueError, match="scales"):
        coded_matmul(torch.randn(1, 64, device=DEVICE), codes, scales[:, :1].contiguous(), None, 32)
    with pytest.raises(ValueError, match="codes"):
        coded_matmul(torch.randn(1, 48, device=DEVICE), codes, scales, None, 32)
    with pytest.raises(ValueError, match=r"codes must be torch\.uint8"):  # packed codes are bytes of K / 2
        coded_matmul(torch.randn(1, 64, device=DEVICE), codes, scales, None, 32, packed=True)
    odd, odd_scales, _ = make_codes(8, 96, 32, False, (0, 15))  # K / 2 = 48: the high half starts inside a group
    with pytest.raises(ValueError, match="K / 2 to be a multiple of the group"):
        coded_matmul(torch.randn(1, 96, device=DEVICE), pack_nibbles(odd), odd_scales, None, 32, packed=True)


def test_plan_is_a_function_of_the_shape() -> None:
    """Decode splits K to fill the SMs (bounded by K's tiles); prefill never splits. (The same plan every call is
    what lets a CUDA graph replay the launch.)"""
    small = plan_coded_matmul(1, 576, 576, 132)
    assert small.block_m == DECODE_ROWS and 1 < small.split <= 8
    assert plan_coded_matmul(1, 576, 576, 132) == small
    assert plan_coded_matmul(1, 576, 128, 132).split == 1  # one K tile: nothing to split
    assert plan_coded_matmul(1, 14336, 4096, 132).split == 1  # 448 column tiles fill 132 SMs already
    assert plan_coded_matmul(64, 576, 576, 132).split == 1
