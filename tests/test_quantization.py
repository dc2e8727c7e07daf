"""`quantization` (vLLM's name): validated by name in the config and the `pagoda serve` flag, and checked against the
model at load; a GGUF model's linears keep their codes alone, computed from them at every row count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_core import LLM, SamplingParams
from engine_core.config import EngineConfig
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels
from services.cli import _parser
from tests.hf_reference import hf_greedy
from tests.test_model_families import VOCAB, _tiny


def test_an_unknown_quantization_is_refused_by_the_flags_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--quantization", "int3"])
    assert "--quantization" in capsys.readouterr().err
    assert _parser().parse_args(["serve", "--quantization", "gguf"]).quantization == "gguf"
    assert EngineConfig().quantization is None


def test_gguf_quantization_of_a_model_without_a_gguf_file_fails_at_load(tmp_path: Path, smollm2_dir: str) -> None:
    model_dir = _tiny("llama", tmp_path / "llama", smollm2_dir)
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model"):
        LLM(str(model_dir), quantization="gguf", kv_cache_memory=0.01)


@pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()), reason="no vectorized coded kernel"
)
def test_codes_alone_serve_prefill_and_decode_with_transformers_tokens(tmp_path: Path, smollm2_dir: str) -> None:
    """GGUF-decoded weights: resident as codes only, and prompts of 300 and 20 tokens in one step (prefill rows past
    every float32 threshold, 320 of them) then decode rows give transformers' float32 greedy tokens."""
    model_dir = _tiny("llama", tmp_path / "llama", smollm2_dir, gguf=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (300, 20)]
    llm = LLM(str(model_dir), kv_cache_memory=0.05, enable_prefix_caching=False)
    for layer in llm.core.executor.model.modules():
        if isinstance(layer, Linear) and layer.cpu_forms is not None:
            forms = layer.cpu_forms
            assert forms.coded is not None and (forms.panels, forms.onednn, forms.plain) == (None, None, None)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 8)
