"""Tiny random-initialised Qwen2 and Mistral models: Pagoda's forward and greedy decoding equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

from engine_core import LLM, SamplingParams
from engine_core.model.layers.cpu_gemm_rows import CODED_M, NEVER, CpuGemmRows
from engine_core.model.layers.linear import UNQUANTIZED, Linear, process_linear_weights
from engine_core.model.layers.selector import select_linear_method
from engine_core.model.loader import iter_weights
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.worker.model_runner import ModelRunner
from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded
from tests.conftest import TRITON_DEVICE
from tests.hf_reference import hf_greedy

VOCAB = 49152  # SmolLM2's tokenizer is saved beside the tiny weights so text prompts work too


def _tiny(kind: str, path: Path, smollm2_dir: str, gguf: bool = False, tied: bool = False) -> Path:
    """A tiny random model of `kind`; with `gguf`, its projections are GGUF blocks decoded (Q4_1, and Q8_0 for the
    LM head), as the default model's are, so that the coded kernel runs them; with `tied`, one table for the
    embedding and the LM head (as the default model's)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaky logits: argmax is not decided by rounding noise
        tie_word_embeddings=tied,
    )
    configs = {
        "qwen2": lambda: Qwen2Config(**common),
        "mistral": lambda: MistralConfig(**common, sliding_window=None),
        "llama": lambda: LlamaConfig(**common),
    }
    config = configs[kind]()
    config.architectures = [{"qwen2": "Qwen2", "mistral": "Mistral", "llama": "Llama"}[kind] + "ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":  # random Q/K/V biases, so a missing bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    if gguf:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2 and "embed" not in name:
                    param.copy_(ref_gguf_decoded(param, "q8_0" if "lm_head" in name else "q4_1"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_tiny_model_greedy_matches_transformers(kind: str, tmp_path: Path, smollm2_dir: str) -> None:
    model_dir = _tiny(kind, tmp_path / kind, smollm2_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (1, 7, 16, 17, 40, 70)]
    llm = LLM(str(model_dir), kv_cache_memory=0.1, max_num_batched_tokens=32)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 20)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_triton_backend_matches_torch_backend_and_transformers(tmp_path: Path, smollm2_dir: str) -> None:
    """The whole model through the Triton kernels (interpreted on CPU) gives transformers' logits and tokens."""
    model_dir = _tiny("llama", tmp_path / "llama", smollm2_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 300, 4000], list(range(100, 121)), [7]]  # lengths 4, 21 (two blocks), 1
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(model_dir),
            kv_cache_memory=0.01,
            attention_backend=backend,
            max_num_batched_tokens=16,
            device=TRITON_DEVICE,
            dtype="float32",
        )
        results[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, p in enumerate(prompts):
        tri, tor = results["triton"][i].outputs[0], results["torch"][i].outputs[0]
        assert tri.token_ids == tor.token_ids == hf_greedy(ref, p, 4)
        with torch.no_grad():
            want = torch.log_softmax(ref(input_ids=torch.tensor([p + tri.token_ids])).logits[0].float(), -1)
        for j, tok in enumerate(tri.token_ids):
            assert tri.logprobs is not None and tor.logprobs is not None
            assert abs(tri.logprobs[j][tok].logprob - float(want[len(p) - 1 + j, tok])) < 1e-4
            assert abs(tri.logprobs[j][tok].logprob - tor.logprobs[j][tok].logprob) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_track_float32(dtype: str, tmp_path: Path, smollm2_dir: str) -> None:
    model_dir = _tiny("qwen2", tmp_path / "qwen2", smollm2_dir)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    prompts = [{"prompt_token_ids": [3, 99, 1024, 7, 5000, 42]}, {"prompt_token_ids": list(range(200, 237))}]
    want = LLM(str(model_dir), kv_cache_memory=0.05).generate(prompts, params, use_tqdm=False)
    got = LLM(str(model_dir), kv_cache_memory=0.05, dtype=dtype).generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        (tok,) = w.outputs[0].token_ids
        assert g.outputs[0].logprobs is not None and w.outputs[0].logprobs is not None
        assert abs(g.outputs[0].logprobs[0][tok].logprob - w.outputs[0].logprobs[0][tok].logprob) < 0.1


def _reload_linears(runner: ModelRunner, model_dir: Path, rows: CpuGemmRows) -> None:
    """Loads the checkpoint's projections again and processes them with the GEMM dispatch `rows`, which keeps only
    the weight forms those thresholds reach; the native decode step is rebuilt over the same layers."""
    model = runner.model
    for layer in model.modules():
        if isinstance(layer, Linear):
            layer.weight = torch.nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)
            layer.method, layer.cpu_forms = UNQUANTIZED, None
    model.load_weights(iter_weights(str(model_dir), runner.hf_config))
    process_linear_weights(model, select_linear_method(runner.device, runner.dtype, rows))
    runner.decode_step = NativeDecodeStep(model)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize(
    ("gguf", "onednn_m", "large_m", "resident"),
    [
        (True, 128, NEVER, {"coded"}),
        (False, 128, NEVER, {"panels", "onednn"}),
        (False, 1, NEVER, {"onednn"}),
        (False, 1, 1, {"plain"}),
    ],
    ids=["coded-gemm", "panel-gemm", "onednn-gemm", "mkl-gemm"],
)
def test_native_decode_step_matches_the_python_layers(
    kind: str, gguf: bool, onednn_m: int, large_m: int, resident: set[str], tmp_path: Path, smollm2_dir: str
) -> None:
    """Decode-only steps run every layer in one native call (kernels/cpu/decode_step.cpp) over the layers' own weight
    forms: same tokens and logprobs as the Python layer loop, through each of its GEMM paths (6 decode rows; the row
    thresholds are moved so each path takes them, and GGUF-decoded weights take the coded kernel). Qwen2 brings the
    Q/K/V biases."""
    model_dir = _tiny(kind, tmp_path / kind, smollm2_dir, gguf=gguf)
    llm = LLM(str(model_dir), kv_cache_memory=0.05, enable_prefix_caching=False)
    runner = llm.core.executor
    if not isinstance(runner.decode_step, NativeDecodeStep):
        pytest.skip("native CPU kernels unavailable")
    coded_m = CODED_M if cpu_kernels.coded_linear_vectorized() else 0
    _reload_linears(runner, model_dir, CpuGemmRows(coded_m, onednn_m, large_m))
    if gguf and not coded_m:
        resident = {"panels", "onednn"}
    for layer in runner.model.modules():
        if isinstance(layer, Linear):  # each weight resident only in the forms its dispatch reads
            assert layer.weight is None and layer.cpu_forms is not None
            forms = {
                name for name in ("coded", "panels", "onednn", "plain") if getattr(layer.cpu_forms, name) is not None
            }
            assert forms == resident, layer
    assert_native_step_matches_layer_loop(llm, (3, 40, 1, 17, 9, 5), max_tokens=12)


def assert_native_step_matches_layer_loop(
    llm: LLM, prompt_lens: tuple[int, ...], max_tokens: int, tolerance: float = 1e-5
) -> None:
    """Greedy generations of random prompts, first with the runner's native decode step, then with every step through
    the model's forward (the layer loop; the runner's decode step is left off): the same tokens, logprobs within
    `tolerance` (0: bitwise)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in prompt_lens]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    native = llm.generate(prompts, params, use_tqdm=False)
    llm.core.executor.decode_step = None
    python = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(native, python, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for tok in pa:
                assert abs(pa[tok].logprob - pb[tok].logprob) <= tolerance
