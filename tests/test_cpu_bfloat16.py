"""dtype="bfloat16" on CPU: bf16 weights in the native bf16 GEMM (or oneDNN's), activations float32
(model/layers/cpu_bfloat16.py); the choice by CPU flags; kv_cache_dtype (a bf16 cache under float32 attention on
CPU) and its validation.

Tolerance of a bf16 product: the inputs rounded to bf16 (8 bits of mantissa), accumulated in fp32, the product
rounded to bf16 once more: within 2^-7 relative of the exact product of the rounded inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core.config import EngineConfig
from engine_core.model.layers.cpu_bfloat16 import (
    BF16_CODED_M,
    CpuBfloat16Method,
    bf16_gemm_rows,
    bf16_gemm_unsupported,
    cpu_bf16_gemms,
    this_cpu_flags,
)
from engine_core.model.layers.cpu_gemm_rows import NEVER, CpuGemmRows
from engine_core.model.layers.linear import Linear
from engine_core.worker.model_runner import ModelRunner
from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded
from tests.test_model_runner import BS, greedy

ZEN4 = ["fpu", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"]
AVX2 = ["fpu", "sse4_2", "avx", "avx2", "fma", "f16c"]
SAPPHIRE_RAPIDS = ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]

has_bf16_gemms = pytest.mark.skipif(
    bf16_gemm_unsupported(this_cpu_flags(), torch.ops.mkldnn._is_mkldnn_bf16_supported()) is not None
    or not cpu_kernels.available(),
    reason="this CPU has no AVX-512 BF16 / AMX (or no native kernels)",
)


def test_the_cpu_flags_decide_whether_bf16_gemms_run() -> None:
    assert bf16_gemm_unsupported(ZEN4) is None
    assert bf16_gemm_unsupported(SAPPHIRE_RAPIDS) is None
    reason = bf16_gemm_unsupported(AVX2)
    assert reason is not None and "avx512_bf16" in reason and "amx_bf16" in reason
    assert bf16_gemm_unsupported(ZEN4, onednn_bf16=False) == "torch's oneDNN has no bf16 kernels here"
    assert cpu_bf16_gemms(AVX2) is False  # and says so in the log (the runner then serves float32)


def _bf16_linear(w: torch.Tensor, b: torch.Tensor, rows: CpuGemmRows | None = None) -> Linear:
    layer = Linear(w.shape[1], w.shape[0], bias=True)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    layer.process_weights(CpuBfloat16Method(rows or CpuGemmRows(0, 0, NEVER)))
    return layer


def _bf16_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact product of the bf16-rounded inputs (float64)."""
    return F.linear(x.bfloat16().double(), w.bfloat16().double(), b.double()).float()


# the two bf16 forms: the native kernel's pair panels at every row count (this CPU's default), or oneDNN's packed
# form (where the native kernels lack AVX-512 BF16)
NATIVE_ROWS, ONEDNN_ROWS = CpuGemmRows(0, NEVER, NEVER), CpuGemmRows(0, 0, NEVER)


@has_bf16_gemms
@pytest.mark.parametrize("form", ["panels", "onednn"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_a_bf16_linear_is_the_product_of_bf16_inputs_in_float32(rows: int, form: str) -> None:
    w, b = torch.randn(96, 200) * 0.1, torch.randn(96)
    layer = _bf16_linear(w, b, NATIVE_ROWS if form == "panels" else ONEDNN_ROWS)
    forms = layer.cpu_forms
    assert forms is not None and forms.bf16 and getattr(forms, form).dtype == torch.bfloat16
    other = "onednn" if form == "panels" else "panels"
    assert getattr(forms, other) is None and forms.plain is None and forms.coded is None and layer.weight is None
    assert layer.resident_bytes() < 96 * 200 * 4  # one bf16 copy (with its padding), no float32 copy
    x = torch.randn(rows, 200)
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _bf16_product(x, w, b), rtol=2**-7, atol=1e-3)
    assert not torch.equal(got, F.linear(x, w, b))  # really bf16: float32 would give other bits
    forms.bf16_out = True  # a consumer that reads bf16 gets the product rounded once, not widened
    assert layer(x).dtype == torch.bfloat16


@has_bf16_gemms
def test_this_cpu_runs_the_native_bf16_kernel_at_every_row_count_past_the_codes() -> None:
    rows = bf16_gemm_rows()
    assert rows.onednn_m == NEVER and rows.large_m == NEVER and rows.coded_m == BF16_CODED_M
    layer = _bf16_linear(torch.randn(40, 64), torch.randn(40), rows)  # no codes: the panels from 1 row
    forms = layer.cpu_forms
    assert forms is not None and forms.panels is not None and forms.onednn is None
    assert layer.resident_bytes() == 2 * 32 * 32 * 2 * 2  # two 32-column panels of 32 k pairs, bf16


@has_bf16_gemms
@pytest.mark.parametrize("rows", [1, BF16_CODED_M - 1, BF16_CODED_M, 40])
def test_a_gguf_weight_keeps_its_codes_below_bf16_coded_m_and_bf16_above(rows: int) -> None:
    w, b = ref_gguf_decoded(torch.randn(96, 64) * 0.1, "q4_1"), torch.randn(96)
    layer = _bf16_linear(w, b, bf16_gemm_rows())
    forms = layer.cpu_forms
    assert forms is not None and forms.coded is not None and forms.panels is not None and forms.onednn is None
    x = torch.randn(rows, 64)
    if rows < BF16_CODED_M:  # the codes: exact float32, the panel kernel's bits
        assert torch.equal(layer(x), cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), 96, b))
    else:
        torch.testing.assert_close(layer(x), _bf16_product(x, w, b), rtol=2**-7, atol=1e-3)


def _runner(model_dir: Path, dtype: str, backend: str) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir), dtype=dtype, block_size=BS, num_kv_blocks=32, max_num_seqs=4, attention_backend=backend
    )
    runner = ModelRunner(config, str(model_dir))
    runner.init_kv_cache(32)
    return runner


@has_bf16_gemms
def test_a_bf16_runner_decodes_greedily_like_float32_on_a_tiny_model(tiny_dir: Path) -> None:
    """Every step kind (prefill, the native decode step) through bf16 GEMMs; the tiny model's logits are peaky, so
    the argmax survives bf16 rounding: the same tokens as float32."""
    prompts = {0: [3, 17, 5, 99, 42], 1: [7], 2: [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    bf16 = _runner(tiny_dir, "bfloat16", "cpu")
    assert bf16.dtype == torch.float32 and bf16.gemm_dtype == torch.bfloat16  # activations stay float32
    assert bf16.decode_step is not None and bf16.kv_caches[0].dtype == torch.bfloat16  # "auto": the model's dtype
    linear = bf16.model.layers[0].self_attn.qkv_proj
    assert linear.method.name == "cpu-bfloat16"
    # gate/up's bf16 product goes into the native SiLU-and-mul as is (MLP.hand_off_bf16): the bits of its fp32
    # product rounded to bf16 and then run through the SiLU-and-mul
    mlp = bf16.model.layers[0].mlp
    forms = mlp.gate_up_proj.cpu_forms
    assert forms is not None and forms.bf16_out
    x = torch.randn(16, mlp.gate_up_proj.in_features)
    assert mlp.gate_up_proj(x).dtype == torch.bfloat16
    handed_off = mlp(x)
    forms.bf16_out = False
    product = mlp.gate_up_proj(x)
    assert product.dtype == torch.float32
    # the down projection's bf16 product goes into the next norm as is (tests/test_bf16_norm_hand_off.py)
    assert handed_off.dtype == torch.bfloat16
    assert torch.equal(handed_off, mlp.down_proj(mlp.ops.silu_and_mul(product.bfloat16())))
    forms.bf16_out = True
    assert greedy(bf16, prompts, steps=6) == greedy(_runner(tiny_dir, "float32", "cpu"), prompts, steps=6)


def test_kv_cache_dtype_names_the_flag_when_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    config = EngineConfig(kv_cache_dtype="bfloat16")
    assert config.resolved_kv_cache_dtype("bfloat16") == "bfloat16"
    assert config.resolved_kv_cache_dtype("float32", "float32", ("bfloat16",)) == "bfloat16"  # the CPU kernels read it
    auto = EngineConfig()
    assert auto.resolved_kv_cache_dtype("float32") == "float32"
    assert auto.resolved_kv_cache_dtype("float32", "bfloat16", ("bfloat16",)) == "bfloat16"  # the model's dtype
    assert auto.resolved_kv_cache_dtype("float32", "bfloat16") == "float32"  # a backend that cannot read bf16
    exact = EngineConfig(dtype="bfloat16", kv_cache_dtype="float32")  # bf16 GEMMs over a float32 cache, on CPU
    assert exact.resolved_kv_cache_dtype("float32", "bfloat16", ("bfloat16",)) == "float32"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float32' needs attention in float32"):
        exact.resolved_kv_cache_dtype("bfloat16", "bfloat16")  # CUDA bf16 attention reads only bf16
    # the torch backend computes in float32 and reads only that: a bf16 cache is refused before any load
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' needs attention in bfloat16.*'auto'"):
        ModelRunner(
            EngineConfig(model=str(tiny_dir), kv_cache_dtype="bfloat16", num_kv_blocks=4, attention_backend="torch"),
            str(tiny_dir),
        )


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
def test_a_bf16_kv_cache_under_float32_decodes_like_float32_on_a_tiny_model(tiny_dir: Path) -> None:
    """kv_cache_dtype="bfloat16" with float32 weights: the native kernels store K/V rounded to bf16 and attend in
    fp32 (prefill chunks, the native decode step); the tiny model's logits are peaky: the same greedy tokens."""
    prompts = {0: [3, 17, 5, 99, 42], 1: [7], 2: [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    config = EngineConfig(
        model=str(tiny_dir), block_size=BS, num_kv_blocks=32, max_num_seqs=4, kv_cache_dtype="bfloat16"
    )
    runner = ModelRunner(config, str(tiny_dir))
    runner.init_kv_cache(32)
    assert runner.kv_dtype == torch.bfloat16 and runner.kv_caches[0].dtype == torch.bfloat16
    assert (
        runner.decode_step is not None
        and runner.info.block_bytes == _runner(tiny_dir, "float32", "cpu").info.block_bytes // 2
    )
    assert greedy(runner, prompts, steps=6) == greedy(_runner(tiny_dir, "float32", "cpu"), prompts, steps=6)
    assert runner.kv_caches[0].any()  # written: the step's K/V went to the bf16 cache


def test_the_worker_and_serve_flags_take_kv_cache_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import _parser
    from services.worker.config import parse_worker_args

    assert parse_worker_args(["--kv-cache-dtype", "bfloat16"]).engine.kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse_worker_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert "kv_cache_dtype must be one of" in capsys.readouterr().err
    serve = _parser().parse_args(["serve", "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"])
    assert (serve.dtype, serve.kv_cache_dtype) == ("bfloat16", "bfloat16")
