"""GGUF models are read from the file: every tensor bit for bit what transformers' GGUF loader makes of it."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    dequantize,
    get_tensor_name_map,
    quantize,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine_core.checkpoint.gguf_file import GgufTensor, read_index
from engine_core.checkpoint.model_dir import GGUF_LINK, gguf_file, transformers_kwargs, weight_files
from engine_core.checkpoint.model_files import default_model_path, resolve_model_dir
from engine_core.model.gguf_weights import decode, iter_gguf_weights
from tests.gguf_writer import finish, gguf_writer, llama_qk_heads, permute_qk

Q = GGMLQuantizationType
# Every format the tiny models are written in: the ones decoded in torch, and Q5_1 (gguf-py's own decoding).
WEIGHT_TYPES = [Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16, Q.BF16, Q.Q5_1, Q.F32]
ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2}


def _tiny_hf(arch: str) -> torch.nn.Module:
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: Q and K are unpermuted with different head counts
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)  # Qwen2's Q/K/V biases, random so a mix-up shows
    return model


def _write_gguf(path: Path, arch: str, model: torch.nn.Module) -> Path:
    """The model as llama.cpp would write it: gguf-py's names, permuted Q/K rows (Llama), blocks per WEIGHT_TYPES."""
    cfg = model.config
    writer = gguf_writer(path, arch, cfg)
    names = get_tensor_name_map(ARCHS[arch], cfg.num_hidden_layers)
    matrices = 0
    for hf, tensor in model.state_dict().items():
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        w = tensor.numpy()
        heads = llama_qk_heads(name, cfg) if arch == "llama" else None
        if heads is not None:
            w = permute_qk(w, heads)
        kind = WEIGHT_TYPES[matrices % len(WEIGHT_TYPES)] if w.ndim == 2 else Q.F32
        matrices += w.ndim == 2
        writer.add_tensor(name, quantize(w, kind), raw_dtype=kind)
    finish(writer)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_tensors_are_transformers_tensors_bit_for_bit(arch: str, tmp_path: Path) -> None:
    model = _tiny_hf(arch)
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, model)
    assert {t.kind for t in read_index(path).tensors} == set(WEIGHT_TYPES)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    ours = dict(iter_gguf_weights(path, model.config.num_attention_heads, model.config.num_key_value_heads))
    assert sorted(ours) == sorted(ref) == sorted(model.state_dict())
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor.float()), name
    # and the decoded model is the model, to the quantization's error (not, say, with Q and K rows swapped)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, atol=0.1, rtol=0.1, msg=name)


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16], ids=lambda k: k.name)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf * 0: the NaN is compared, not the warning
def test_decoding_any_bytes_matches_gguf_py(kind: Q) -> None:
    """Every bit pattern, scales that are inf, NaN or subnormal included, decodes as gguf-py decodes it."""
    block, block_bytes = {Q.Q8_0: (32, 34), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.F16: (1, 2), Q.BF16: (1, 2)}[kind]
    rows, cols = 64, 128
    raw = torch.randint(
        0, 256, (rows * cols // block * block_bytes,), dtype=torch.uint8, generator=torch.manual_seed(1)
    )
    tensor = GgufTensor(name="w", shape=(rows, cols), kind=kind, offset=0, nbytes=raw.numel())
    ref = torch.from_numpy(dequantize(raw.numpy().reshape(rows, -1), kind).copy()).float()
    torch.testing.assert_close(decode(tensor, raw), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", [Q.Q8_1, Q.Q8_K, Q.F64], ids=lambda k: k.name)
def test_a_type_without_a_decoder_is_refused_naming_the_tensor_and_type(kind: Q) -> None:
    block, block_bytes = GGML_QUANT_SIZES[kind]
    raw = torch.zeros(4 * block_bytes, dtype=torch.uint8)
    tensor = GgufTensor(name="blk.0.ffn_up.weight", shape=(4, block), kind=kind, offset=0, nbytes=raw.numel())
    with pytest.raises(ValueError, match=f"'blk.0.ffn_up.weight' is of type {kind.name}, which the engine cannot"):
        decode(tensor, raw)


def test_the_default_models_directory_links_its_gguf_file_and_holds_no_weights(smollm2_dir: str) -> None:
    link = gguf_file(smollm2_dir)
    assert link is not None and link.resolve() == Path(default_model_path()).resolve()
    assert not list(Path(smollm2_dir).glob("*.safetensors"))
    assert transformers_kwargs(smollm2_dir) == {"gguf_file": link.name}


@pytest.mark.slow
def test_the_default_models_tensors_are_transformers_tensors_bit_for_bit(smollm2_hf_model: torch.nn.Module) -> None:
    ref = smollm2_hf_model
    ours = dict(iter_gguf_weights(default_model_path(), ref.config.num_attention_heads, ref.config.num_key_value_heads))
    state = ref.state_dict()
    assert sorted(ours) == sorted(k for k in state if k != "lm_head.weight")  # tied: the embedding serves both
    for name, tensor in ours.items():
        assert torch.equal(tensor, state[name]), name


def test_an_unsupported_architecture_is_refused_before_any_conversion(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        resolve_model_dir(str(path), str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def tiny_gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", _tiny_hf("llama")).read_bytes()


@settings(max_examples=80, deadline=None)
@given(keep=st.one_of(st.integers(0, 2048), st.integers(0, 1 << 30)))  # in the header, or anywhere
def test_a_truncated_file_is_refused_by_name(
    tiny_gguf_bytes: bytes, tmp_path_factory: pytest.TempPathFactory, keep: int
) -> None:
    path = tmp_path_factory.mktemp("cut") / "cut.gguf"
    path.write_bytes(tiny_gguf_bytes[: keep % len(tiny_gguf_bytes)])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        read_index(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b: b"GGML" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + struct.pack("<I", 1) + b[8:], "version 1 is not supported"),
        (lambda b: b[:8] + struct.pack("<Q", 1 << 40) + b[16:], "implausible header"),
        (lambda b: b[:16] + struct.pack("<Q", 1 << 62) + b[24:], "implausible header"),
    ],
)
def test_a_malformed_header_is_refused_by_name(tiny_gguf_bytes: bytes, tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(edit(tiny_gguf_bytes))
    with pytest.raises(ValueError, match=message):
        read_index(path)


def test_a_directory_whose_gguf_file_moved_fails_the_load_by_the_files_name(tmp_path: Path) -> None:
    from engine_core.model.loader import iter_weights

    (tmp_path / GGUF_LINK).symlink_to(tmp_path / "gone.gguf")
    assert weight_files(tmp_path) == [tmp_path / GGUF_LINK]
    with pytest.raises(FileNotFoundError, match=r"model\.gguf"):
        next(iter_weights(str(tmp_path), LlamaConfig(num_attention_heads=4, num_key_value_heads=2)))
