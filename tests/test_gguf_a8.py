"""quantization="gguf_a8" (model/layers/gguf_a8.py): the default model's 4-bit codes times 8-bit activations, on the
real SmolLM2 weights: what each linear keeps and runs, the native decode step against the layer loop, the stated
quality against float32, and the refusals, each naming its flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core import LLM
from engine_core.config import EngineConfig
from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
from engine_core.model.layers.gguf_a8 import A8_M, gguf_a8_unsupported
from engine_core.model.layers.linear import Linear
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.model.quantization import resolve_weight_format
from kernels import cpu as cpu_kernels
from services.cli import _parser
from tests.test_bf16_quality import _top1, agreement, float32_reference  # noqa: F401 (a fixture)
from tests.test_model_families import _tiny, assert_native_step_matches_layer_loop

needs_a8 = pytest.mark.skipif(
    gguf_a8_unsupported(torch.device("cpu"), this_cpu_flags()) is not None, reason="no AVX2 + FMA native kernels here"
)

# NOTE: measured over these teacher-forced prompts (docs/benchmarks.md, "gguf_a8 on AVX2"); on quality.py's public
# text its top-1 agreement with float32 is ~92.6 % (int8's W8A8: ~86 %, bf16: ~99 %), perplexity +0.8 %.
MIN_TOP1_AGREEMENT = 0.90
MAX_LOGPROB_DRIFT = 0.10  # mean |logprob_a8 - logprob_fp32| of float32's top token, nats


@pytest.fixture(scope="module")
def a8_llm(smollm2_dir: str) -> LLM:
    return LLM(smollm2_dir, quantization="gguf_a8", kv_cache_memory=0.3, enable_prefix_caching=False)


@needs_a8
@pytest.mark.slow
def test_each_linear_keeps_its_codes_once_and_4_bit_ones_run_with_8_bit_activations(a8_llm: LLM) -> None:
    runner = a8_llm.core.executor
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears
    four_bit = 0
    for layer in linears:
        forms = layer.cpu_forms
        assert forms is not None and forms.coded is not None and forms.rows.a8_m == A8_M
        assert forms.panels is None and forms.onednn is None and forms.plain is None
        if cpu_kernels.coded_a8_reads(forms.coded):
            four_bit += 1
            x = torch.randn(3, forms.coded.shape[1] * 32)
            exact = cpu_kernels.coded_linear(x, forms.coded, forms.out_features, layer.bias)
            got = layer(x)
            assert torch.equal(got, cpu_kernels.coded_a8_linear(x, forms.coded, forms.out_features, layer.bias))
            assert not torch.equal(got, exact)
    assert four_bit == 4 * runner.hf_config.num_hidden_layers  # every projection is Q4_1; the tied head is Q8_0


@needs_a8
@pytest.mark.slow
def test_the_native_decode_step_matches_the_layer_loop(a8_llm: LLM) -> None:
    runner = a8_llm.core.executor
    assert isinstance(runner.decode_step, NativeDecodeStep)
    try:
        assert_native_step_matches_layer_loop(a8_llm, (3, 40, 1, 17, 9), max_tokens=10)
    finally:
        runner.decode_step = NativeDecodeStep(runner.model)


@needs_a8
@pytest.mark.slow
def test_gguf_a8_picks_float32s_top_token_at_almost_every_position(
    a8_llm: LLM,
    float32_reference: tuple[list[list[int]], list[list[tuple[int, float]]]],  # noqa: F811
) -> None:
    texts, want = float32_reference
    agree, drift = agreement(_top1(a8_llm, texts), want)
    print(f"gguf_a8 vs float32: top-1 agreement {agree:.4f}, mean drift {drift:.4f}")
    assert agree >= MIN_TOP1_AGREEMENT
    assert 0 < drift <= MAX_LOGPROB_DRIFT  # > 0: another computation than float32's, really


def test_gguf_a8_is_refused_where_it_cannot_run(tmp_path: Path, smollm2_dir: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="quantization='gguf_a8' needs a CPU with avx2 and fma; this one lacks fma"):
        resolve_weight_format("gguf_a8", str(tmp_path), cpu, cpu_flags={"avx2"})
    with pytest.raises(ValueError, match="quantization='gguf_a8' runs on CPU, not cuda"):
        resolve_weight_format("gguf_a8", str(tmp_path), torch.device("cuda"), cpu_flags={"avx2", "fma"})
    with pytest.raises(ValueError, match="quantization='gguf_a8' runs float32 activations; dtype='bfloat16'"):
        EngineConfig(quantization="gguf_a8", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"quantization='gguf_a8' needs a \.gguf model"):
        LLM(str(_tiny("llama", tmp_path / "llama", smollm2_dir)), quantization="gguf_a8", kv_cache_memory=0.01)
    assert _parser().parse_args(["serve", "--quantization", "gguf_a8"]).quantization == "gguf_a8"
