"""The model's Triton path (attention backend `triton`): its fused RMSNorm / rotary / SiLU-and-mul kernels give the
eager layers' tokens and logprobs (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_core import LLM, SamplingParams
from engine_core.model.layers.layer_ops import TORCH_OPS
from engine_core.model.llama import MLP, Attention, RMSNorm
from tests.conftest import TRITON_DEVICE
from tests.test_model_families import VOCAB, _tiny


def test_fused_triton_ops_match_the_eager_layers(tmp_path: Path, smollm2_dir: str) -> None:
    model_dir = _tiny("qwen2", tmp_path / "qwen2", smollm2_dir)  # Q/K/V biases too
    llm = LLM(
        str(model_dir),
        attention_backend="triton",
        kv_cache_memory=0.01,
        max_num_batched_tokens=16,
        device=TRITON_DEVICE,
        dtype="float32",
        enforce_eager=True,  # the layer loop, where the modules can be switched between steps
    )
    model = llm.core.executor.model
    fused_modules = [m for m in model.modules() if isinstance(m, RMSNorm | Attention | MLP)]
    assert fused_modules and all(m.ops.name == "triton" for m in fused_modules), "the runner did not switch them on"
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in (4, 9, 1)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    fused = llm.generate(prompts, params, use_tqdm=False)
    model.use_layer_ops(TORCH_OPS)  # the eager torch layers (not the native CPU ops: a different implementation)
    eager = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, eager, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert abs(pa[tok].logprob - pb[tok].logprob) < 1e-4
