"""`quantization="int8"` on CPU: per-channel codes, both kernels against the float product of those codes, the
compressed-tensors int8 checkpoint format (accepted variants load to the same codes; the rest refused by field), and
the refusals at load that name the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core import LLM, SamplingParams
from engine_core.checkpoint.compressed_tensors import parse_quantization_config
from engine_core.config import EngineConfig
from engine_core.model.compressed_tensors_weights import iter_int8_checkpoint
from engine_core.model.layers import int8_gemm as int8_gemm_module
from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
from engine_core.model.layers.cpu_int8 import CpuInt8Method, int8_dot_products
from engine_core.model.layers.int8_gemm import Int8Weight, int8_gemm, quantize_per_channel
from engine_core.model.layers.linear import Linear
from engine_core.model.native_decode import NativeDecodeStep
from engine_core.model.quantization import resolve_weight_format
from kernels import cpu as cpu_kernels
from services.cli import _parser
from tests.test_model_families import VOCAB, _tiny, assert_native_step_matches_layer_loop

needs_vnni = pytest.mark.skipif(not int8_dot_products(this_cpu_flags()), reason="no int8 dot products here")


def test_per_channel_codes_round_trip_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen) * torch.linspace(0.01, 3.0, 96)[:, None]
    w[7] = 0.0
    codes, scale = quantize_per_channel(w)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (96,)
    assert int(codes.abs().max()) == 127 and int(codes.min()) >= -127
    assert torch.all(codes[7] == 0) and scale[7] == 1.0
    err = (codes.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5))
    # quantizing the dequantized weight gives the same codes (how a checkpoint's codes survive the load)
    again, scale2 = quantize_per_channel(codes.float() * scale[:, None])
    assert torch.equal(again, codes) and torch.allclose(scale2, scale, rtol=1e-6)


@needs_vnni
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 160, 192), (5, 150, 190), (64, 160, 192), (9, 7, 3), (2, 576, 960)])
@pytest.mark.parametrize("kernel", ["weight_only", "w8a8"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_both_kernels_track_the_float_product_of_the_codes(
    rows: int, k: int, n: int, kernel: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kernel, native (kernels/cpu/int8_ops.cpp) and torch's, against the float32 product of the same codes;
    shapes off the kernels' 16-wide vectors and 4-channel tiles included (K % 16, N % 4, rows % 4)."""
    if not native:
        if k % 16 or n % 16:
            pytest.skip("torch's _weight_int8pack_mm needs K and N in multiples of 16 (it crashes on others)")
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    elif not cpu_kernels.available():
        pytest.skip("native CPU kernels unavailable")
    gen = torch.Generator().manual_seed(rows)
    codes, scale = quantize_per_channel(torch.randn(n, k, generator=gen))
    w = Int8Weight(codes, scale, w8a8_m=10**9 if kernel == "weight_only" else 0)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    want = x.double() @ (codes.double() * scale.double()[:, None]).T + bias.double()
    got = int8_gemm(w, x, bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    zero = int8_gemm(w, torch.zeros(rows, k), bias)  # zero rows (scale 1, codes 0) give the bias exactly
    assert torch.equal(zero, bias.expand(rows, -1))
    rel = ((got.double() - want).norm() / (want - bias.double()).norm()).item()
    # NOTE: measured ~3e-5 native weight-only (x in 16 bits per row on VNNI; ~1e-7 in float32 without it), ~0.3 %
    # torch's (bf16 x) and ~0.8 % W8A8 (int8 x); a wrong scale or layout is >= 10 %
    assert rel < (1e-4 if native and kernel == "weight_only" else 0.02), rel
    if native and kernel == "w8a8":  # the native passes quantize x as torch's did: the same codes, the same int32 sums
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
        assert torch.allclose(got, int8_gemm(w, x, bias), rtol=1e-5, atol=1e-5)


@needs_vnni
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 576, 1536), (3, 130, 9), (2, 64, 4), (1, 1536, 7), (4, 7, 5)])
def test_weight_only_kernel_sums_16_bit_activations_exactly(rows: int, k: int, n: int) -> None:
    """The weight-only kernel on VNNI quantizes x per row to 16 bits (round(x / s), s = max|x| / 32767) and sums its
    products with the codes in integers: with rows whose largest |x| is 32767 (s = 1, xq = x) and scales of 1, the
    output is the exact integer product rounded once to float32. Shapes off the 64-byte vectors (K % 64), the
    4-channel tiles (N % 4) and the 2-row tiles, and every extreme of x and the codes, included."""
    if not cpu_kernels.available() or not cpu_kernels.int8_weight_only_vnni():
        pytest.skip("no native VNNI weight-only kernel here")
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(-32767, 32768, (rows, k), generator=gen)
    x[:, 0] = 32767
    x[0, 1:] = -32767  # the most negative high byte in every position of one row
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int64)
    codes[0] = 127
    codes[-1, 1:] = -127
    got = cpu_kernels.int8_linear(x.float(), codes.to(torch.int8), torch.ones(n), None, 1 << 62)
    assert torch.equal(got, (x @ codes.T).float())
    # a channel's scale and the row's come in once each, on the float32 of the exact sum, then the bias
    scale, bias = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen)
    got = cpu_kernels.int8_linear((x * 0.5).float(), codes.to(torch.int8), scale, bias, 1 << 62)
    want = (x @ codes.T).float() * 0.5 * scale + bias
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    # a row holding an inf or a NaN gives NaN outputs (not codes from a garbage scale) and leaves the other rows alone
    bad = x.float().repeat(2, 1)
    bad[0, k // 2], bad[1, k - 1] = float("inf"), float("nan")
    got = cpu_kernels.int8_linear(bad, codes.to(torch.int8), torch.ones(n), None, 1 << 62)
    assert torch.isnan(got[:2]).all() and torch.equal(got[2:], (x.repeat(2, 1)[2:] @ codes.T).float())


@needs_vnni
@pytest.mark.parametrize("w8a8_m", [1 << 62, 1], ids=["weight-only", "w8a8"])
def test_int8_native_decode_step_matches_the_python_layers(w8a8_m: int, tmp_path: Path, smollm2_dir: str) -> None:
    """Decode-only int8 steps run the native whole-step decode (kernels/cpu/decode_step.cpp calls int8_ops.cpp's op
    on the layers' own codes): the same tokens and logprobs as the Python layer loop, through each int8 kernel.
    Weight-only, the layers run in one parallel region each (decode_int8.cpp), each thread a fixed share of every
    product's channels: the same tiles and fused ops as the loop's, so the logprobs are bitwise the loop's, batch 1
    (the last steps) and five rows (shares that split tiles unevenly)."""
    model_dir = _tiny("qwen2", tmp_path / "qwen2", smollm2_dir)  # Qwen2: Q/K/V biases through the int8 op too
    llm = LLM(str(model_dir), quantization="int8", kv_cache_memory=0.05, enable_prefix_caching=False)
    runner = llm.core.executor
    if not isinstance(runner.decode_step, NativeDecodeStep):
        pytest.skip("native CPU kernels unavailable")
    for layer in runner.model.modules():
        if isinstance(layer, Linear):  # the codes alone, resident once
            assert layer.cpu_forms is not None and layer.cpu_forms.int8 is not None
            assert layer.cpu_forms.int8.w8a8_m == CpuInt8Method().w8a8_m
            assert all(getattr(layer.cpu_forms, f) is None for f in ("coded", "panels", "onednn", "plain"))
            layer.cpu_forms.int8.w8a8_m = w8a8_m
    runner.decode_step = NativeDecodeStep(runner.model)
    exact = w8a8_m > 1
    assert_native_step_matches_layer_loop(llm, (3, 40, 1, 17, 9), max_tokens=10, tolerance=0.0 if exact else 1e-5)


def test_int8_is_refused_on_a_cpu_without_int8_dot_products_or_avx2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cpu = torch.device("cpu")
    refused = r"quantization='int8' needs a CPU with one of avx512_vnni.*or with avx2 and fma"
    with pytest.raises(ValueError, match=refused):
        resolve_weight_format("int8", str(tmp_path), cpu, cpu_flags={"sse4_2", "avx"})
    assert resolve_weight_format("int8", str(tmp_path), cpu, cpu_flags={"avx512_vnni"}).int8
    assert not resolve_weight_format(None, str(tmp_path), cpu, cpu_flags=set()).int8
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs a checkpoint"):
        resolve_weight_format("compressed-tensors", str(tmp_path), cpu, cpu_flags={"avx512_vnni"})
    # CUDA runs int8 through Triton whatever the host CPU has (layers/cuda_codes.py); other devices are refused
    assert resolve_weight_format("int8", str(tmp_path), torch.device("cuda"), cpu_flags=set()).int8
    with pytest.raises(ValueError, match="runs on CPU or CUDA, not mps"):
        resolve_weight_format("int8", str(tmp_path), torch.device("mps"), cpu_flags={"avx512_vnni"})


def test_int8_names_are_flags() -> None:
    assert EngineConfig(quantization="int8").quantization == "int8"
    for name in ("int8", "compressed-tensors"):
        assert _parser().parse_args(["serve", "--quantization", name]).quantization == name
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def _scheme(weights: dict | None = None, inputs: dict | str | None = "token", **top: object) -> dict:
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    a = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": {**w, **(weights or {})}, "input_activations": a}
    if inputs is None:
        group["input_activations"] = None
    elif isinstance(inputs, dict):
        group["input_activations"] = {**a, **inputs}
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group}}
    return {"quantization_config": {**qc, "ignore": ["lm_head"], **top}}


def test_compressed_tensors_variants_accepted_and_refused_by_field() -> None:
    assert parse_quantization_config({}) is None
    assert parse_quantization_config({"quantization_config": {"quant_method": "gptq"}}) is None
    w8a8 = parse_quantization_config(_scheme())
    assert w8a8 is not None and w8a8.w8a8 and w8a8.ignore == ("lm_head",)
    w8a16 = parse_quantization_config(_scheme(inputs=None))
    assert w8a16 is not None and not w8a16.w8a8
    refused = {
        "weights.strategy": _scheme(weights={"strategy": "group", "group_size": 128}),
        "weights.symmetric": _scheme(weights={"symmetric": False}),
        "weights.num_bits": _scheme(weights={"num_bits": 4}),
        "weights.type": _scheme(weights={"type": "float"}),
        "input_activations.dynamic": _scheme(inputs={"dynamic": False}),
        "input_activations.strategy": _scheme(inputs={"strategy": "tensor"}),
        "quantization_config.format": _scheme(format="pack-quantized"),
    }
    for field, raw in refused.items():
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            parse_quantization_config(raw)


def test_an_int8_weight_without_its_scale_is_named() -> None:
    w = torch.ones(4, 3, dtype=torch.int8)
    merged = dict(iter_int8_checkpoint([("a.weight_scale", torch.full((4, 1), 0.5)), ("a.weight", w)]))
    assert torch.equal(merged["a.weight"], torch.full((4, 3), 0.5))
    with pytest.raises(ValueError, match=r"int8 weight 'b\.weight' has no weight_scale"):
        list(iter_int8_checkpoint([("b.weight", w)]))
    with pytest.raises(ValueError, match=r"'c\.input_scale' is not supported"):
        list(iter_int8_checkpoint([("c.input_scale", torch.ones(1))]))
    with pytest.raises(ValueError, match=r"d\.weight_scale: expected a float scale per output channel \(4\)"):
        list(iter_int8_checkpoint([("d.weight", w), ("d.weight_scale", torch.ones(3))]))


def _compressed_tensors_copy(float_dir: Path, target: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`float_dir`'s model written as a compressed-tensors W8A8 checkpoint (per-channel codes, scale = absmax / 127,
    lm_head kept float as in `ignore`); returns each quantized weight's (codes, scale)."""
    target.mkdir()
    tensors = load_file(str(float_dir / "model.safetensors"))
    out, quantized = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            codes, scale = quantize_per_channel(t)
            out[name], out[f"{name}_scale"] = codes, scale[:, None].clone()
            quantized[name.removeprefix("model.")] = (codes, scale)
        else:
            out[name] = t
    save_file(out, str(target / "model.safetensors"))
    for f in float_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (target / f.name).write_bytes(f.read_bytes())
    config = json.loads((float_dir / "config.json").read_text())
    config |= _scheme()
    (target / "config.json").write_text(json.dumps(config))
    return quantized


@needs_vnni
def test_a_compressed_tensors_checkpoint_loads_its_own_codes(tmp_path: Path, smollm2_dir: str) -> None:
    """The W8A8 checkpoint's codes and scales are the layers' (Q/K/V and gate/up stacked in order), and it decodes the
    same tokens as `quantization="int8"` on the float model it was quantized from (the same codes, the same
    kernels)."""
    float_dir = _tiny("llama", tmp_path / "float", smollm2_dir)
    quantized = _compressed_tensors_copy(float_dir, tmp_path / "ct")
    ct = LLM(str(tmp_path / "ct"), kv_cache_memory=0.02, enable_prefix_caching=False)
    model = ct.core.executor.model
    layer = model.layers[1]
    fused = {
        layer.self_attn.qkv_proj: ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        layer.mlp.gate_up_proj: ("mlp.gate_proj", "mlp.up_proj"),
        layer.mlp.down_proj: ("mlp.down_proj",),
    }
    for linear, parts in fused.items():
        assert isinstance(linear, Linear) and linear.weight is None
        int8 = linear.cpu_forms.int8 if linear.cpu_forms is not None else None
        assert int8 is not None
        want = [quantized[f"layers.1.{p}.weight"] for p in parts]
        assert torch.equal(int8.codes, torch.cat([c for c, _ in want]))
        assert torch.allclose(int8.scale, torch.cat([s for _, s in want]), rtol=1e-6)
    # the checkpoint's float LM head runs int8 too (quantized at load)
    assert model.lm_head.cpu_forms is not None and model.lm_head.cpu_forms.int8 is not None
    got = greedy_tokens(ct)
    del ct
    assert got == greedy_tokens(LLM(str(float_dir), quantization="int8", kv_cache_memory=0.02))


def greedy_tokens(llm: LLM) -> list[list[int]]:
    """Greedy continuations (6 tokens) of two fixed random prompts."""
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in (40, 7)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_refused_compressed_tensors_scheme_fails_at_load_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_scheme(weights={"strategy": "tensor"})))
    with pytest.raises(ValueError, match=r"config_groups\.group_0\.weights\.strategy = 'tensor'"):
        LLM(str(tmp_path), kv_cache_memory=0.01)


@pytest.mark.parametrize(
    ("w8a8_wins", "expected"),
    [
        ((False, False, True, True, True, True), 8),  # the crossover the race finds
        ((False, True, False, True, True, True), 16),  # W8A8 from a count it wins at every larger one
        ((False,) * 6, 64),  # weight-only "wins" everywhere (a disturbed race): W8A8 from 64 rows anyway
        ((False, False, False, False, True, False), 32),  # 64 rows are W8A8's whatever their race said
    ],
)
def test_w8a8_crossover_is_at_most_the_largest_raced_row_count(
    monkeypatch: pytest.MonkeyPatch, w8a8_wins: tuple[bool, ...], expected: int
) -> None:
    """The load-time race picks where W8A8 takes over; a race that a busy machine disturbs never runs 64-row steps
    weight-only (several times W8A8's cost there). The timer is replaced by each count's outcome."""
    outcomes = iter(w8a8_wins)

    def race(runs: dict[str, object], repeats: int) -> dict[str, float]:
        won = next(outcomes)
        return {"weight_only": 2.0 if won else 1.0, "w8a8": 1.0 if won else 2.0}

    monkeypatch.setattr(int8_gemm_module, "_best_of", race)
    int8_gemm_module.w8a8_from_rows.cache_clear()
    try:
        assert int8_gemm_module.w8a8_from_rows() == expected
    finally:
        int8_gemm_module.w8a8_from_rows.cache_clear()
