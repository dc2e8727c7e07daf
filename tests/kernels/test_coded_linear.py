"""Block-coded weights: found exactly in GGUF-decoded float32 weights by `coded_pack`, and read by `coded_linear`
with the panel kernel's bits at every row count (kernels/cpu/coded_linear.cpp)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core.model.layers.cpu_gemm_rows import CODED_M, NEVER, ONEDNN_M, CpuGemmRows
from engine_core.model.layers.gguf_codes import GgufCodesMethod
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded as gguf_decoded

BLOCK = 32
BITS = {384: 4, 640: 8}  # record bytes -> bits per code

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")


def decoded(records: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 weights `[n, K]` that records hold (the identity through `coded_linear`)."""
    k = records.shape[1] * BLOCK
    return cpu_kernels.coded_linear(torch.eye(k), records, n, None).T.contiguous()


@pytest.mark.parametrize(("kind", "bits"), [("q4_1", 4), ("q8_0", 8)])
def test_codes_are_found_and_decode_to_the_same_weights(kind: str, bits: int) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 192, generator=g) * 0.05
    w[3, 32:64] = 0.25  # a constant block
    w[4, 64:96] = 0.0  # scale 0
    w = gguf_decoded(w, kind)
    records = cpu_kernels.coded_pack(w)
    assert records is not None and BITS[records.shape[2]] == bits
    assert records.shape[:2] == (5, 6)  # ceil(70 / 16) panels, 192 / 32 blocks
    assert torch.equal(decoded(records, 70), w)


@pytest.mark.parametrize(("kind", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 8), ("Q5_1", 8), ("Q8_0", 8)])
def test_every_legacy_gguf_format_is_found_as_codes(kind: str, bits: int) -> None:
    """Blocks quantized by gguf-py (llama.cpp's quantizers) and decoded as the loader decodes them (model/
    gguf_weights.py): their codes are found, decode to the same weights, and multiply with the panel kernel's bits.
    K-quants (sub-block scales) are not found from values: the loader carries their codes (test_kquant_codes.py)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quantize

    from engine_core.checkpoint.gguf_file import GgufTensor
    from engine_core.model.gguf_weights import decode

    qtype = GGMLQuantizationType[kind]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 256, generator=g) * 0.05
    w[2, :32] = 0.0  # an all-zero block (d = 0)
    raw = torch.from_numpy(quantize(w.numpy(), qtype).reshape(-1))
    assert raw.numel() == 40 * 256 // 32 * GGML_QUANT_SIZES[qtype][1]
    weights = decode(GgufTensor("w", (40, 256), qtype, 0, raw.numel()), raw)
    records = cpu_kernels.coded_pack(weights)
    assert records is not None and BITS[records.shape[2]] == bits
    assert torch.equal(decoded(records, 40), weights)
    x = torch.randn(20, 256, generator=g)
    assert torch.equal(
        cpu_kernels.coded_linear(x, records, 40, None),
        cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(weights), 40, None),
    )
    k_quant = decode(
        GgufTensor("w", (16, 256), GGMLQuantizationType.Q4_K, 0, 16 * 144),
        torch.randint(0, 256, (16 * 144,), dtype=torch.uint8, generator=g),
    )
    assert cpu_kernels.coded_pack(k_quant) is None


def test_weights_that_are_not_codes_are_left_alone() -> None:
    g = torch.Generator().manual_seed(2)
    assert cpu_kernels.coded_pack(torch.randn(16, 64, generator=g)) is None  # training weights
    assert cpu_kernels.coded_pack(torch.randn(16, 64, generator=g).bfloat16().float()) is None
    assert cpu_kernels.coded_pack(torch.randn(16, 48, generator=g)) is None  # K not a multiple of 32
    w = gguf_decoded(torch.randn(16, 64, generator=g), "q4_1")
    assert cpu_kernels.coded_pack(w) is not None
    w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(1.0))  # one weight off by one ulp
    assert cpu_kernels.coded_pack(w) is None
    w[5, 7] = float("nan")
    assert cpu_kernels.coded_pack(w) is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 40, 301])
@pytest.mark.parametrize(("n", "with_bias"), [(96, False), (50, True)])
def test_coded_linear_gives_the_panel_kernels_bits(kind: str, rows: int, n: int, with_bias: bool) -> None:
    """Rows decoded in registers (up to 16 on AVX-512, 4 on AVX2), then panels decoded once (from 17 or 5 rows: pairs,
    an odd last panel, the panel kernel's row blocks), a partial last panel (N % 16 != 0), with and without a bias."""
    g = torch.Generator().manual_seed(rows)
    w = gguf_decoded(torch.randn(n, 576, generator=g) * 0.05, kind)
    b = torch.randn(n, generator=g) if with_bias else None
    records = cpu_kernels.coded_pack(w)
    assert records is not None
    x = torch.randn(rows, 576, generator=g)
    got = cpu_kernels.coded_linear(x, records, n, b)
    assert torch.equal(got, cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), n, b))
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [5, 40])
def test_coded_linear_takes_strided_rows_and_any_thread_count(rows: int) -> None:
    w = gguf_decoded(torch.randn(72, 64) * 0.1, "q4_1")
    records = cpu_kernels.coded_pack(w)
    assert records is not None
    x = torch.randn(rows, 200)[:, 8:72]  # row stride 200, as a projection's output view gives it
    want = cpu_kernels.coded_linear(x.contiguous(), records, 72, None)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(cpu_kernels.coded_linear(x, records, 72, None), want)
    finally:
        torch.set_num_threads(threads)


def test_coded_linear_rejects_records_of_another_shape() -> None:
    w = gguf_decoded(torch.randn(40, 64), "q8_0")
    records = cpu_kernels.coded_pack(w)
    assert records is not None
    with pytest.raises(RuntimeError, match="coded_linear: records must be"):
        cpu_kernels.coded_linear(torch.randn(2, 96), records, 40, None)
    with pytest.raises(RuntimeError, match="coded_linear: records must be"):
        cpu_kernels.coded_linear(torch.randn(2, 64), records[:, :, :100].contiguous(), 40, None)


def _gguf_linear(w: torch.Tensor, b: torch.Tensor) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], bias=True)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.process_weights(GgufCodesMethod(CpuGemmRows(CODED_M, ONEDNN_M, NEVER)))
    return layer


@pytest.mark.parametrize("rows", [1, 4, 5, 15, 16, 17, 31, 64, 128, 200])
def test_a_gguf_linear_reads_its_codes_alone_at_every_row_count_with_the_panel_kernels_bits(rows: int) -> None:
    """Up to 16 rows (4 on AVX2) the records are decoded in registers, above a panel pair at a time into a buffer:
    both give the panel kernel's bits on the decoded weights, and no float32 form of the weight stays resident."""
    w, b = gguf_decoded(torch.randn(96, 64) * 0.1, "q4_1"), torch.randn(96)
    layer = _gguf_linear(w, b)
    forms = layer.cpu_forms
    assert forms is not None and forms.coded is not None
    assert forms.panels is None and forms.onednn is None and forms.plain is None
    x = torch.randn(rows, 64)
    assert torch.equal(layer(x), cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), 96, b))
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    plain = _gguf_linear(torch.randn(96, 64), b).cpu_forms
    assert plain is not None and plain.coded is None and plain.panels is not None  # no codes: the float32 forms


@pytest.mark.slow
def test_the_default_models_projections_all_have_codes(smollm2_dir: str) -> None:
    """The default GGUF (Q4_1 layers, Q8_0 tied embedding) takes the coded kernel at every row count."""
    from engine_core.model.loader import iter_weights, load_config

    weights = iter_weights(smollm2_dir, load_config(smollm2_dir))
    records = {name: cpu_kernels.coded_pack(t) for name, t in weights if t.dim() == 2}
    bits = {name: None if r is None else BITS[r.shape[2]] for name, r in records.items()}
    assert bits.pop("model.embed_tokens.weight") == 8
    assert len(bits) == 7 * 30 and set(bits.values()) == {4}, Path(smollm2_dir).name
