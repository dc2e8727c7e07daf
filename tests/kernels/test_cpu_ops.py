"""The native CPU ops (kernels/cpu, C++ built at first use) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_gemm_rows import LARGE_M, NEVER, ONEDNN_M, CpuGemmRows
from engine_core.model.layers.layer_ops import NativeCpuOps, apply_rotary
from engine_core.model.layers.linear import Linear
from engine_core.model.llama import RMSNorm
from kernels import cpu as cpu_kernels
from kernels.reference import ref_store_kv

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")


@pytest.mark.parametrize("rows", [1, 3, 67])
def test_silu_and_mul(rows: int) -> None:
    x = torch.randn(rows, 2 * 1536) * 4
    gate, up = x.split(1536, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(x), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 67])
@pytest.mark.parametrize("width", [1536, 1541])
def test_silu_and_mul_in_bf16_is_the_float32_op_rounded_once(rows: int, width: int) -> None:
    """bf16 in, bf16 out (the bf16 GEMMs' hand-off): the float32 op's arithmetic on the widened inputs, the result
    rounded to nearest even once, as float32's output cast to bf16: the same bits, a row's tail past the last vector,
    denormal products and infinities included (and NaN where float32 gives NaN)."""
    x = torch.randn(rows, 2 * width) * 4
    x[0, :4] = torch.tensor([-80.0, 1.0, float("inf"), float("nan")])  # gate: a tiny product, -0 below, inf, NaN
    x[0, width : width + 4] = torch.tensor([1e-6, -0.0, 2.0, 1.0])
    x = x.bfloat16()
    got = cpu_kernels.silu_and_mul(x)
    assert got.dtype == torch.bfloat16
    want = cpu_kernels.silu_and_mul(x.float()).bfloat16()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # the bits: -0, denormals
    assert want[0, 0] != 0 and want[0, 0].abs() < torch.finfo(torch.bfloat16).tiny  # a denormal, kept


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_torch_module(with_residual: bool) -> None:
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = torch.randn(33, 576) * 3
    residual = torch.randn(33, 576) if with_residual else None
    want_out, want_res = norm(x.clone(), None if residual is None else residual.clone())
    norm.ops = NativeCpuOps()
    got_out, got_res = norm(x.clone(), None if residual is None else residual.clone())
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_res, want_res)


def test_rotary_rotates_q_and_k_in_place_and_leaves_v() -> None:
    t, heads, kv_heads, d = 9, 4, 2, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    angles = torch.rand(t, d // 2) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    cos_sin = (cos.unsqueeze(1), sin.unsqueeze(1))
    want_q = apply_rotary(q.reshape(t, heads, d), cos_sin)
    want_k = apply_rotary(k.reshape(t, kv_heads, d), cos_sin)
    want_v = v.clone()
    cpu_kernels.rotary_embedding(qkv, cos, sin, heads + kv_heads, d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    torch.testing.assert_close(q.reshape(t, heads, d), want_q, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k.reshape(t, kv_heads, d), want_k, atol=1e-6, rtol=1e-5)
    assert torch.equal(v, want_v)


def test_store_kv_writes_slots_and_skips_padding() -> None:
    blocks, bs, kv_heads, d = 6, 4, 2, 8
    cache = torch.randn(2, blocks, bs, kv_heads, d)
    expected = cache.clone()
    kv = torch.randn(5, 2 * kv_heads * d)  # k and v as strided views of one buffer, as the projection gives them
    k, v = (x.view(5, kv_heads, d) for x in kv.split(kv_heads * d, dim=-1))
    slots = torch.tensor([3, 17, -1, 0, 23])
    ref_store_kv(k, v, expected[0], expected[1], slots)
    cpu_kernels.store_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)


def test_bad_inputs_are_rejected_with_the_op_name() -> None:
    with pytest.raises(RuntimeError, match="silu_and_mul: float32 or bfloat16 only"):
        cpu_kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    cache = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="store_kv: slot out of range"):
        cpu_kernels.store_kv(cache, torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([8]))
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_kernels.paged_decode_attention(
            q, cache, torch.tensor([[5]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 1.0
        )


@pytest.mark.parametrize("rows", [1, 5, ONEDNN_M, LARGE_M - 1, LARGE_M])
@pytest.mark.parametrize(("onednn_m", "large_m"), [(NEVER, NEVER), (ONEDNN_M, LARGE_M), (0, LARGE_M), (0, NEVER)])
def test_cpu_float32_linear_every_path_gives_the_same_product(rows: int, onednn_m: int, large_m: int) -> None:
    w, b = torch.randn(96, 64) * 0.1, torch.randn(96)
    layer = Linear(64, 96, bias=True)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.process_weights(CpuFloat32Method(CpuGemmRows(0, onednn_m, large_m)))
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("k", "n"), [(576, 960), (37, 50), (100, 7), (1536, 33), (130, 16)])
def test_panel_pack_is_the_zero_padded_column_panels(k: int, n: int) -> None:
    """[ceil(N/16), K, 16]: panel p, row k holds W[16p .. 16p+15, k], zeros past column N (K not a multiple of the
    packing's k-block, too)."""
    w = torch.randn(n, k)
    panels = -(-n // 16)
    want = F.pad(w, (0, 0, 0, panels * 16 - n)).view(panels, 16, k).transpose(1, 2)
    assert torch.equal(cpu_kernels.panel_pack(w), want)


@pytest.mark.parametrize("rows", [1, 5, 7, 13, 64, 130])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (37, 50), (100, 7), (1536, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_a_float64_reference(rows: int, k: int, n: int, with_bias: bool) -> None:
    """Row blocks of every height (1..6), a partial last panel (N % 16 != 0) and K of any size."""
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) if with_bias else None
    x = torch.randn(rows, k)
    got = cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), n, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_panel_linear_takes_strided_rows() -> None:
    wide = torch.randn(9, 200)
    x = wide[:, 8:72]  # 64 columns, row stride 200: a column slice, as a projection's output view gives it
    w = torch.randn(40, 64) * 0.1
    got = cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), 40, None)
    assert torch.equal(got, cpu_kernels.panel_linear(x.contiguous(), cpu_kernels.panel_pack(w), 40, None))
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), atol=1e-5, rtol=1e-5)


def test_panel_linear_is_the_same_whatever_the_thread_count() -> None:
    x, w, b = torch.randn(70, 576), torch.randn(1000, 576) * 0.05, torch.randn(1000)
    packed = cpu_kernels.panel_pack(w)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            results.append(cpu_kernels.panel_linear(x, packed, 1000, b))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    # and each row is the same whether it comes alone or in a batch (no blocking-dependent order)
    assert torch.equal(cpu_kernels.panel_linear(x[3:4], packed, 1000, b)[0], results[0][3])


def test_panel_linear_rejects_a_mismatched_packing() -> None:
    packed = cpu_kernels.panel_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="panel_linear: shapes do not match"):
        cpu_kernels.panel_linear(torch.randn(2, 64), packed, 60, None)
