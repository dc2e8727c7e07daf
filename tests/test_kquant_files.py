"""benchmarks/kquant_files.py's float32 GGUF, the source that llama.cpp's quantizer turns into the K-quant files of
docs/benchmarks.md's quality table: every tensor gguf-py's decoding of the source, bit for bit, under the same
name, shape and order, and the metadata copied with `general.file_type` ALL_F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, dequantize
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.kquant_files import write_float32_gguf
from tests.test_kquant_codes import KINDS, _write_kquant_gguf


def test_float32_gguf_is_the_sources_decoding(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    src, dst = tmp_path / "model.gguf", tmp_path / "model.F32.gguf"
    kinds = _write_kquant_gguf(src, model, torch.Generator().manual_seed(0))
    assert set(kinds.values()) == set(KINDS)
    write_float32_gguf(src, dst)

    source, written = GGUFReader(src), GGUFReader(dst)
    assert [t.name for t in written.tensors] == [t.name for t in source.tensors]
    for a, b in zip(source.tensors, written.tensors, strict=True):
        assert b.tensor_type == GGMLQuantizationType.F32
        assert list(b.shape) == list(a.shape)
        assert np.array_equal(np.asarray(b.data).reshape(-1), dequantize(a.data, a.tensor_type).reshape(-1))
    assert written.fields["general.file_type"].contents() == LlamaFileType.ALL_F32
    for name, field in source.fields.items():
        if not name.startswith("GGUF.") and name != "general.file_type":
            assert written.fields[name].contents() == field.contents(), name
