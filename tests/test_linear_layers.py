"""Linear layers own their weight format (engine_core/model/layers): fused loading through `weight_loader`, and each
weight resident once, in the forms its row-count dispatch reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_core import LLM
from engine_core.model.layers.cpu_float32 import CpuFloat32Method
from engine_core.model.layers.cpu_gemm_rows import NEVER, ONEDNN_M, CpuGemmRows
from engine_core.model.layers.linear import UNQUANTIZED, Linear
from kernels import cpu as cpu_kernels
from tests.test_model_families import _tiny


def test_weight_loader_stacks_the_shards_of_a_fused_projection() -> None:
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    bq, bk, bv = torch.randn(8), torch.randn(2), torch.randn(2)
    layer = Linear(4, 12, bias=True, output_sizes=(8, 2, 2))
    for shard, w, b in [(2, v, bv), (0, q, bq), (1, k, bk)]:  # in any order, as a checkpoint lists them
        layer.weight_loader(layer.weight, w, shard)
        layer.weight_loader(layer.bias, b, shard)
    assert layer.weight is not None and layer.bias is not None
    assert torch.equal(layer.weight, torch.cat([q, k, v])) and torch.equal(layer.bias, torch.cat([bq, bk, bv]))
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat([q, k, v]), torch.cat([bq, bk, bv])))


def test_weight_loader_refuses_a_tensor_of_the_wrong_shape_or_a_missing_shard_id() -> None:
    layer = Linear(4, 12, bias=False, output_sizes=(8, 2, 2))
    with pytest.raises(ValueError, match=r"shape \[3, 4\] for a slot of \[2, 4\]"):
        layer.weight_loader(layer.weight, torch.randn(3, 4), 1)
    with pytest.raises(ValueError, match="needs a shard id"):
        layer.weight_loader(layer.weight, torch.randn(12, 4))
    with pytest.raises(ValueError, match="do not add up"):
        Linear(4, 12, bias=False, output_sizes=(8, 2))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")
@pytest.mark.parametrize(
    ("rows", "resident"),
    [
        (CpuGemmRows(0, ONEDNN_M, NEVER), {"panels", "onednn"}),
        (CpuGemmRows(0, 0, NEVER), {"onednn"}),
        (CpuGemmRows(0, ONEDNN_M, 512), {"panels", "onednn", "plain"}),
        (CpuGemmRows(0, NEVER, NEVER), {"panels"}),
    ],
)
def test_a_cpu_float32_weight_is_resident_only_in_the_forms_its_dispatch_reads(
    rows: CpuGemmRows, resident: set[str]
) -> None:
    w = torch.randn(40, 64)
    layer = Linear(64, 40, bias=False)
    layer.weight_loader(layer.weight, w)
    layer.process_weights(CpuFloat32Method(rows))
    assert layer.weight is None and layer.cpu_forms is not None  # the loaded parameter is gone
    kept = {name for name in ("coded", "panels", "onednn", "plain") if getattr(layer.cpu_forms, name) is not None}
    assert kept == resident
    for m in (1, 7, 130, 600):
        x = torch.randn(m, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_a_gguf_models_linears_keep_their_codes_alone(tmp_path: Path, smollm2_dir: str) -> None:
    """The worker's weights: no plain float32 copy beside the packed forms (unless MKL runs prefill on this CPU); a
    weight with codes keeps its codes alone (a quarter of the float32 bytes for Q4_1, 0.31 for Q8_0)."""
    model_dir = _tiny("llama", tmp_path / "llama", smollm2_dir, gguf=True)
    llm = LLM(str(model_dir), kv_cache_memory=0.01)
    linears = [m for m in llm.core.executor.model.modules() if isinstance(m, Linear)]
    assert linears
    for layer in linears:
        float32_bytes = layer.in_features * layer.out_features * 4
        if layer.method is UNQUANTIZED:  # no oneDNN here: F.linear on the one plain weight
            assert layer.resident_bytes() == float32_bytes
            continue
        forms = layer.cpu_forms
        assert layer.weight is None and forms is not None
        assert (forms.plain is None) == (forms.rows.large_m == NEVER)
        float32_forms = sum(f is not None for f in (forms.panels, forms.onednn, forms.plain))
        if forms.rows.coded_m > 0:  # the vectorized coded kernel: every projection of this model has codes
            assert forms.coded is not None and float32_forms == 0
        assert layer.resident_bytes() <= (float32_forms + (0.35 if forms.coded is not None else 0)) * float32_bytes
