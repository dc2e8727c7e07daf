"""`quantization="int8"` on a CPU without int8 dot products (model/layers/cpu_int8_records.py): the per-channel
int8 codes kept as the coded kernel's 8-bit records alone, computed as the float32 product of the dequantized
weight (the panel kernel's bits), through the layer loop, the native decode step and a tied embedding.

The engine picks this form from the CPU's flags; the tests here pin the flags to an AVX2 CPU's, so they run the same
on a VNNI machine (where `quantization="int8"` otherwise picks the int8 form, tests/test_int8.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core import LLM
from engine_core.model.layers import selector
from engine_core.model.layers.coded_embedding import CodedEmbedding
from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.cpu_int8 import int8_unsupported
from engine_core.model.layers.cpu_int8_records import CpuInt8RecordsMethod, int8_records
from engine_core.model.layers.int8_gemm import quantize_per_channel
from engine_core.model.layers.linear import Linear
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.model.quantization import resolve_weight_format
from kernels import cpu as cpu_kernels
from tests.test_bf16_quality import _top1, agreement, float32_reference  # noqa: F401 (a fixture)
from tests.test_int8 import _compressed_tensors_copy, greedy_tokens
from tests.test_model_families import _tiny, assert_native_step_matches_layer_loop

AVX2 = frozenset({"avx2", "fma"})
pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()), reason="no vectorized coded kernel here"
)


@pytest.fixture
def avx2_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The linear method is chosen as on a CPU with AVX2 + FMA and no int8 dot products."""
    monkeypatch.setattr(selector, "this_cpu_flags", lambda: AVX2)


def _decoded(records: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """The weight the records hold, row by row (the tied embedding's decoding)."""
    return CodedEmbedding(records, rows, k)(torch.arange(rows))


def _weight(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=gen) * torch.linspace(0.01, 3.0, rows)[:, None]
    w[rows // 2] = 0.0  # a row of zeros: scale 1, codes 0
    return w


@pytest.mark.parametrize(("n", "k"), [(50, 64), (192, 576), (7, 1536)])
def test_records_are_the_codes_times_their_channel_scale(n: int, k: int) -> None:
    """Each record's d is its channel's scale and m is 0, so the records decode to codes * scale exactly, and
    `coded_linear` on them gives the float32 panel kernel's bits on that dequantized weight at every row count."""
    codes, scale = quantize_per_channel(_weight(n, k))
    records = int8_records(codes, scale)
    assert records.shape == (-(-n // 16), k // 32, 640) and records.dtype == torch.uint8
    dequantized = codes.float() * scale[:, None]
    assert torch.equal(_decoded(records, n, k), dequantized)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=gen)
    panels = cpu_kernels.panel_pack(dequantized)
    for m in (1, 2, 3, 4, 5, 16, 64, 200):
        x = torch.randn(m, k, generator=gen)
        got = cpu_kernels.coded_linear(x, records, n, bias)
        assert torch.equal(got, cpu_kernels.panel_linear(x, panels, n, bias))
        want = x.double() @ dequantized.double().T + bias.double()
        bound = k * 2.0**-24 * (x.abs().double() @ dequantized.abs().double().T + bias.abs().double())
        assert torch.all((got.double() - want).abs() <= bound)  # a float32 sum's error bound


def test_a_weight_whose_in_features_the_records_cannot_hold_keeps_its_int8_codes() -> None:
    """in_features not a multiple of 32: the int8 codes alone, through `int8_linear` weight-only at every row count."""
    rows = CpuGemmRows.for_this_cpu()
    layer = Linear(40, 24, bias=True)
    weight = _weight(24, 40)
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(torch.linspace(-1, 1, 24))
    layer.process_weights(CpuInt8RecordsMethod(rows))
    forms = layer.cpu_forms
    assert forms is not None and forms.coded is None and forms.int8 is not None and forms.int8.w8a8_m == NEVER
    codes, scale = quantize_per_channel(weight)
    assert torch.equal(forms.int8.codes, codes)
    x = torch.randn(130, 40, generator=torch.Generator().manual_seed(2))
    want = x.double() @ (codes.double() * scale.double()[:, None]).T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)


def test_int8_is_accepted_on_an_avx2_cpu(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert int8_unsupported(AVX2) is None
    assert resolve_weight_format("int8", str(tmp_path), torch.device("cpu"), cpu_flags=AVX2).int8


@pytest.mark.parametrize(("kind", "tied"), [("qwen2", False), ("llama", True)], ids=["qwen2-biases", "llama-tied"])
def test_int8_runs_as_records_alone_and_the_native_step_is_the_layer_loop(
    kind: str, tied: bool, avx2_cpu: None, tmp_path: Path, smollm2_dir: str
) -> None:
    """Every linear keeps its records alone (1.25 bytes a weight), a tied embedding reads its rows from the LM head's
    records, and decode-only steps through the native decode step give the layer loop's tokens and logprobs bit for
    bit (the same coded kernel on the same records)."""
    model_dir = _tiny(kind, tmp_path / kind, smollm2_dir, tied=tied)
    llm = LLM(str(model_dir), quantization="int8", kv_cache_memory=0.05, enable_prefix_caching=False)
    runner = llm.core.executor
    model = runner.model
    for layer in model.modules():
        if isinstance(layer, Linear):
            forms = layer.cpu_forms
            assert forms is not None and forms.coded is not None and layer.method.name == "cpu-int8-records"
            assert all(getattr(forms, f) is None for f in ("panels", "onednn", "plain", "int8"))
            n, k = forms.out_features, forms.coded.shape[1] * 32
            assert forms.nbytes() == -(-n // 16) * 16 * k * 5 // 4
    if tied:
        assert isinstance(model.embed_tokens, CodedEmbedding)
        assert model.embed_tokens.records.data_ptr() == model.lm_head.cpu_forms.coded.data_ptr()
    if not isinstance(runner.decode_step, NativeDecodeStep):
        pytest.skip("native CPU kernels unavailable")
    assert_native_step_matches_layer_loop(llm, (3, 40, 1, 17, 9), max_tokens=10, tolerance=0.0)


def test_a_compressed_tensors_checkpoint_keeps_its_codes_as_records(
    avx2_cpu: None, tmp_path: Path, smollm2_dir: str
) -> None:
    """A W8A8 checkpoint on a CPU without int8 dot products: its codes and scales are the records' (Q/K/V stacked),
    and it decodes greedily as `quantization="int8"` on the float model it was quantized from."""
    float_dir = _tiny("llama", tmp_path / "float", smollm2_dir)
    quantized = _compressed_tensors_copy(float_dir, tmp_path / "ct")
    ct = LLM(str(tmp_path / "ct"), kv_cache_memory=0.02, enable_prefix_caching=False)
    qkv = ct.core.executor.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Linear) and qkv.cpu_forms is not None and qkv.cpu_forms.coded is not None
    parts = [quantized[f"layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    want = torch.cat([codes.float() * scale[:, None] for codes, scale in parts])
    assert torch.equal(_decoded(qkv.cpu_forms.coded, *want.shape), want)
    got = greedy_tokens(ct)
    del ct
    assert got == greedy_tokens(LLM(str(float_dir), quantization="int8", kv_cache_memory=0.02))


# NOTE: weight-only int8 (float32 activations): measured 0.965 / 0.043 nats on an AVX2 EPYC. W8A8 on VNNI CPUs loses
# more (tests/test_int8_quality.py: ~0.90-0.92 / ~0.13): the activations' per-token scales are most of int8's loss.
MIN_TOP1_AGREEMENT = 0.93
MAX_LOGPROB_DRIFT = 0.07  # mean |logprob_int8 - logprob_fp32| of float32's top token, nats


@pytest.mark.slow
def test_records_int8_picks_float32s_top_token_at_almost_every_position(
    avx2_cpu: None,
    smollm2_dir: str,
    float32_reference: tuple[list[list[int]], list[list[tuple[int, float]]]],  # noqa: F811
) -> None:
    """As tests/test_int8_quality.py, for the records form on the real SmolLM2 weights."""
    texts, want = float32_reference
    agree, drift = agreement(_top1(LLM(smollm2_dir, quantization="int8", kv_cache_memory=0.5), texts), want)
    print(f"int8 records vs float32: top-1 agreement {agree:.4f}, mean logprob drift {drift:.4f}")
    assert agree >= MIN_TOP1_AGREEMENT
    assert 0 < drift <= MAX_LOGPROB_DRIFT  # > 0: the int8 run really is another computation
