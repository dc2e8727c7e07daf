"""`make gpu-check`'s script, end to end on CPU (`--dry-run`: Triton interpreter, tiny shapes): every section runs
and lands in the JSON report. What it measures on a GPU is not checked here, only that it gets there."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run `make gpu-check` itself (not --dry-run)")
def test_gpu_check_dry_run_writes_every_section(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    gpu_check = importlib.import_module("benchmarks.gpu_check")
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report) == [name for name, _, _ in gpu_check.SECTIONS]
    expected_variants = "skipped" if gpu_check.INTERPRETED else "ok"
    assert {k: v["status"] for k, v in report.items()} == {
        "environment": "ok",
        "variants": expected_variants,
        "greedy": "ok",
        "spec_decode": "ok",
        "features": "ok",
        "tensor_parallel": "skipped",  # needs two GPUs
        "kernel_bench": "ok",
        "throughput": "ok",
        "host_profile": "ok",
        "quantized": "ok",
        "kernel_tests": "ok",
    }
    assert report["environment"]["triton_interpreted"] == (not torch.cuda.is_available())
    assert report["greedy"]["float32_triton_eq_torch_eq_transformers"] is True
    for shape in ("smollm2", "llama8b"):
        (row,) = report["kernel_bench"][shape]["decode"]
        assert row["triton_ms"] > 0 and row["splits"] >= 1
        assert len(report["kernel_bench"][shape]["prefill"]) == 1
    assert report["throughput"]["pagoda"]["output_tok_s"] > 0
    assert report["throughput"]["transformers"]["output_tok_s"] > 0
    assert report["throughput"]["pagoda_scaled_8192"]["requests"] == 4
    # fp32 Triton against fp32 transformers: the same most likely token at every prompt position
    assert report["greedy"]["bfloat16_top1_agreement_with_float32"]["pagoda_triton_float32"] == 1.0
    assert report["spec_decode"]["checks"]["suffix_eq_plain"]["result"]["accepted_tokens"] > 0
    assert report["features"]["checks"]["failed"] == []
    assert "engine_core" in report["host_profile"]["top_by"]["cumulative"]
    assert "2 passed" in report["kernel_tests"]["summary"]
    quantized = report["quantized"]
    assert quantized["failed_checks"] == []
    assert quantized["kernel"]["worst_rel_err"] < 1e-5  # fp32 in the dry run
    assert quantized["kernel"]["smollm2"][0]["int8_ms"] > 0 and quantized["kernel"]["llama8b"][0]["q4_1_gbs"] > 0
    assert quantized["gguf_greedy"]["float32_codes_eq_transformers"] is True
    assert quantized["int8"]["batch1_decode"]["gguf_codes"]["ms_per_token"] > 0
