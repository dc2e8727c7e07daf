"""The CUDA linears' codes (engine_core/model/layers/cuda_codes.py), run here on CPU tensors through Triton's
interpreter: every GGUF format's codes kept alone and multiplied through `coded_matmul` to the float weight's
product; int8 per output channel; a fused projection of mixed formats; the loader's legacy codes (Q/K rows
unpermuted) equal to the values transformers decodes; a whole GGUF model on the coded GEMM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from engine_core.checkpoint.gguf_file import read_index
from engine_core.model.gguf_kquants import unpack_kquant
from engine_core.model.gguf_legacy_codes import LEGACY
from engine_core.model.gguf_weights import iter_gguf_weights
from engine_core.model.layers.block_codes import BlockCodes
from engine_core.model.layers.cuda_codes import CudaCodesMethod
from engine_core.model.layers.int8_gemm import quantize_per_channel
from engine_core.model.layers.linear import Linear
from engine_core.model.layers.selector import select_linear_method
from tests.test_gguf_weights import WEIGHT_TYPES, _tiny_hf, _write_gguf
from tests.test_kquant_codes import kquant_bytes

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = _tiny_hf("llama")
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", model), model


def _rows_close(y: torch.Tensor, expected: torch.Tensor) -> None:
    # NOTE: fp32 throughout; the kernel's sums run in another order than F.linear's (decoded weights are exact)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_the_loader_gives_every_legacy_matrix_as_codes_of_transformers_values(
    tiny_gguf: tuple[Path, torch.nn.Module],
) -> None:
    path, model = tiny_gguf
    cfg = model.config
    plain = dict(iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads))
    coded = dict(iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads, True, legacy_codes=True))
    cpu_coded = dict(iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads, True))
    as_codes = {name for name, t in coded.items() if isinstance(t, BlockCodes)}
    assert as_codes and not any(isinstance(t, BlockCodes) for t in cpu_coded.values())  # CPU: not asked for
    assert any("q_proj" in n for n in as_codes) and any("k_proj" in n for n in as_codes)  # unpermuted rows
    for name, item in coded.items():
        values = item.values() if isinstance(item, BlockCodes) else item
        assert torch.equal(values, plain[name]), name
    legacy = {t.kind for t in read_index(path).tensors if t.kind in LEGACY and len(t.shape) == 2}
    assert legacy == {k for k in WEIGHT_TYPES if k in LEGACY}  # Q4_1, Q8_0, Q4_0, Q5_1 all among them


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_gguf_linears_keep_their_codes_alone_and_compute_the_float_product(
    tiny_gguf: tuple[Path, torch.nn.Module], rows: int
) -> None:
    path, model = tiny_gguf
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    for name, item in iter_gguf_weights(path, cfg.num_attention_heads, cfg.num_key_value_heads, True, True):
        if not isinstance(item, BlockCodes):
            continue
        n, k = item.shape
        layer = Linear(k, n, bias=True)
        layer.weight_loader(layer.weight, item.values(), None, item)
        layer.bias.data.normal_(generator=gen)  # type: ignore[union-attr]
        bias = layer.bias.detach().clone()  # type: ignore[union-attr]
        layer.process_weights(CudaCodesMethod(int8=False))
        assert layer.weight is None and layer.device_codes is not None, name
        scale_arrays = 1 if item.offsets is None else 2
        packed = item.bits == 4  # Q4_0 / Q4_1: two codes a byte
        assert layer.device_codes.packed == packed, name  # type: ignore[union-attr]
        assert layer.resident_bytes() == n * k // (1 + packed) + scale_arrays * 4 * n * (k // 32), name
        assert layer.resident_bytes() < n * k * 2  # one byte a code: less than a bf16 copy
        x = torch.randn(rows, k, generator=gen)
        _rows_close(layer(x), F.linear(x, item.values(), bias))


def test_a_fused_projection_of_mixed_formats_keeps_one_set_of_codes() -> None:
    """Q4_K q / k beside a Q6_K v (llama.cpp's Q4_K_M): stacked in 16-k groups with offsets (`cat_rows`), exact;
    Q4_K alone is packed two codes a byte."""
    gen = torch.Generator().manual_seed(4)
    sizes, kinds = [32, 16, 16], (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    codes = [
        unpack_kquant(kind, kquant_bytes(kind, r, 256, gen, 1e-3).reshape(-1), (r, 256))
        for kind, r in zip(kinds, sizes, strict=True)
    ]
    layer = Linear(256, 64, bias=False, output_sizes=sizes)
    for shard, c in enumerate(codes):
        layer.weight_loader(layer.weight, c.values(), shard, c)
    layer.process_weights(CudaCodesMethod(int8=False))
    held = layer.device_codes
    assert held is not None and held.group == 16 and held.offsets is not None and layer.weight is None
    assert not held.packed  # Q6_K's codes need 6 bits
    w = torch.cat([c.values() for c in codes])
    for rows in (1, 20):
        x = torch.randn(rows, 256, generator=gen)
        _rows_close(layer(x), x @ w.T)
    q4k = Linear(256, 32, bias=False)
    q4k.weight_loader(q4k.weight, codes[0].values(), None, codes[0])
    q4k.process_weights(CudaCodesMethod(int8=False))
    assert (
        q4k.device_codes is not None and q4k.device_codes.packed and q4k.resident_bytes() == 32 * 128 + 2 * 4 * 32 * 8
    )
    x = torch.randn(3, 256, generator=gen)
    _rows_close(q4k(x), x @ codes[0].values().T)


def test_int8_keeps_per_channel_codes_and_computes_their_product() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 80, generator=gen)
    layer = Linear(80, 48, bias=False)
    layer.weight_loader(layer.weight, w)
    layer.process_weights(CudaCodesMethod(int8=True))
    assert layer.weight is None and layer.device_codes is not None and layer.device_codes.group == 0
    assert layer.resident_bytes() == 48 * 80 + 48 * 4  # the codes and one float32 scale a row
    q, scale = quantize_per_channel(w)
    x = torch.randn(5, 80, generator=gen)
    _rows_close(layer(x.view(1, 5, 80)).view(5, 48), (x @ q.float().T) * scale)
    assert (layer(x) - x @ w.T).abs().max() < 0.05 * (x.abs() @ w.abs().T).max()  # and near the float product


def test_a_weight_without_codes_stays_plain_and_cuda_selects_the_codes_method() -> None:
    w = torch.randn(16, 32)
    layer = Linear(32, 16, bias=False)
    layer.weight_loader(layer.weight, w)
    layer.process_weights(CudaCodesMethod(int8=False))
    assert layer.device_codes is None and layer.weight is not None
    x = torch.randn(2, 32)
    assert torch.equal(layer(x), F.linear(x, w))
    cuda = torch.device("cuda")
    assert isinstance(select_linear_method(cuda, torch.bfloat16), CudaCodesMethod)
    assert select_linear_method(cuda, torch.float32, int8=True).name == "cuda-int8"


@pytest.mark.slow  # ~75 s: every linear of two layers and a 49,152-row LM head interpreted
@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_model_on_the_coded_gemm_gives_the_cpu_paths_tokens(
    tied: bool, tmp_path: Path, smollm2_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama GGUF file whose matrices are Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 by turns (fused Q/K/V and gate/up mix
    formats; the tied LM head reads the Q8_0 embedding's codes), loaded as the CUDA runner loads it (legacy codes
    from the file, `CudaCodesMethod` selected) with every linear run through `coded_matmul` (interpreted): the CPU
    coded path's greedy tokens (transformers' float32 decoding of the file, tests/test_greedy_equality.py), prefill
    past 16 rows and decode."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_check_quantized import write_gguf_model

    from engine_core import LLM, SamplingParams
    from engine_core.model import loader
    from engine_core.worker import model_runner
    from tests.test_model_families import _tiny

    src = _tiny("llama", tmp_path / "src", smollm2_dir)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": tied}))
    kinds = write_gguf_model(src, tmp_path / "gguf")
    assert set(kinds.values()) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"}
    assert ("lm_head.weight" in kinds) != tied
    prompts = [{"prompt_token_ids": list(range(300, 340))}, {"prompt_token_ids": [5, 900, 17]}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    want = LLM(str(tmp_path / "gguf"), kv_cache_memory=0.05).generate(prompts, params, use_tqdm=False)

    # the CUDA runner's two choices, on this CPU: the legacy formats' codes from the file, and the CUDA method
    def iter_with_legacy_codes(model_dir: str, hf: object, with_codes: bool = False, legacy_codes: bool = False):
        return loader.iter_weights(model_dir, hf, with_codes, legacy_codes=True)

    monkeypatch.setattr(model_runner, "iter_weights", iter_with_legacy_codes)
    monkeypatch.setattr(model_runner, "select_linear_method", lambda *a, **k: CudaCodesMethod(int8=False))
    llm = LLM(str(tmp_path / "gguf"), kv_cache_memory=0.05)
    runner = llm.core.executor
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert runner.decode_step is None  # no native step: the layer loop runs every linear's `apply`
    assert len(linears) == 2 * 4 + 1 and all(m.device_codes is not None and m.weight is None for m in linears)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wl, gl, tok in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, w.outputs[0].token_ids, strict=True):
            assert abs(wl[tok].logprob - gl[tok].logprob) < 1e-3
