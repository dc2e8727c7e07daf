"""GGUF's legacy block formats as codes (engine_core/model/gguf_legacy_codes.py): `values()` of the unpacked codes is
gguf-py's `dequantize` of the same bytes, bit for bit, on weights quantized by gguf-py itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from engine_core.model.gguf_legacy_codes import LEGACY, unpack_legacy


@pytest.mark.parametrize("kind", list(LEGACY), ids=lambda k: k.name)
def test_codes_decode_to_gguf_py_values(kind: GGMLQuantizationType) -> None:
    rows, k = 12, 96
    gen = np.random.default_rng(0)
    w = (gen.standard_normal((rows, k)) * gen.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block: d = 0
    raw = quantize(w, kind)
    expected = torch.from_numpy(dequantize(raw, kind).copy()).reshape(rows, k)
    codes = unpack_legacy(kind, torch.from_numpy(raw.reshape(-1).view(np.uint8).copy()), (rows, k))
    assert codes.q.dtype == torch.int8 and codes.q.shape == (rows, k) and codes.scales.shape == (rows, k // 32)
    assert torch.equal(codes.values(), expected)
    assert codes.q.min() >= (-128 if kind == GGMLQuantizationType.Q8_0 else 0)
    top = {GGMLQuantizationType.Q8_0: 127, GGMLQuantizationType.Q5_0: 31, GGMLQuantizationType.Q5_1: 31}.get(kind, 15)
    assert codes.q.max() <= top
