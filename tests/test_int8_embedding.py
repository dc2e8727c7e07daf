"""A tied table under `quantization="int8"` is held once, as the LM head's int8 codes: the embedding (the layer loop's
module and the native step's gather, kernels/cpu/decode_int8.cpp) reads row r as codes[r] * scale[r], bit for bit
the same in both, and no float copy of the table stays resident; an untied embedding stays float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine_core import LLM
from engine_core.model.layers.cpu_bfloat16 import this_cpu_flags
from engine_core.model.layers.cpu_int8 import int8_dot_products
from engine_core.model.layers.int8_embedding import Int8Embedding
from engine_core.model.layers.linear import Linear
from engine_core.model.llama import Embedding, LlamaForCausalLM
from engine_core.model.native_decode import NativeDecodeStep
from kernels import cpu as cpu_kernels
from tests.test_model_families import VOCAB, _tiny, assert_native_step_matches_layer_loop

pytestmark = pytest.mark.skipif(not int8_dot_products(this_cpu_flags()), reason="no int8 dot products here")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> Path:
    return _tiny("llama", tmp_path_factory.mktemp("tied"), smollm2_dir, tied=True)


@pytest.fixture(scope="module")
def tied_int8(tied_dir: Path) -> Iterator[LLM]:
    yield LLM(str(tied_dir), quantization="int8", kv_cache_memory=0.05, enable_prefix_caching=False)


def _model(llm: LLM) -> LlamaForCausalLM:
    return llm.core.executor.model


def _float_bytes_by_shape(model: LlamaForCausalLM) -> dict[tuple[int, ...], int]:
    """Bytes of every floating-point parameter and buffer the model holds, by shape."""
    out: dict[tuple[int, ...], int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            out[tuple(t.shape)] = out.get(tuple(t.shape), 0) + t.numel() * t.element_size()
    return out


def test_a_tied_int8_table_is_resident_once_as_the_heads_codes(tied_int8: LLM, tied_dir: Path) -> None:
    model = _model(tied_int8)
    hidden = model.config.hidden_size
    head = model.lm_head.cpu_forms
    assert head is not None and head.int8 is not None and model.lm_head.weight is None
    assert isinstance(model.embed_tokens, Int8Embedding)
    assert model.embed_tokens.codes is head.int8.codes and model.embed_tokens.scale is head.int8.scale
    floats = _float_bytes_by_shape(model)
    assert (VOCAB, hidden) not in floats  # no float copy of the table, as a parameter or a buffer
    assert sum(floats.values()) < VOCAB * hidden  # the norms and rotary tables only: under a quarter of the table
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight is None for m in linears)
    # the table's one resident form: the head's codes and scales (49,152 x 64 bytes + 4 per row)
    assert model.lm_head.resident_bytes() == head.int8.nbytes() == VOCAB * (hidden + 4)
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))  # the checkpoint is tied too


def test_the_embedding_rows_are_the_heads_codes_times_their_scales(tied_int8: LLM, tied_dir: Path) -> None:
    model = _model(tied_int8)
    head = model.lm_head.cpu_forms
    assert head is not None and head.int8 is not None
    codes, scale = head.int8.codes, head.int8.scale
    got = model.embed_tokens(torch.arange(VOCAB))
    assert got.dtype == torch.float32 and torch.equal(got, codes.float() * scale[:, None])
    ids = torch.tensor([[0, 7, VOCAB - 1], [7, 3, 3]])
    assert torch.equal(model.embed_tokens(ids), got[ids])
    # and they are the checkpoint's table within half a quantization step per row
    table = load_file(str(tied_dir / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert ((got - table).abs() <= scale[:, None] * (0.5 + 1e-5)).all()
    assert not torch.equal(got, table)  # quantized: the rows really changed
    with pytest.raises(IndexError):
        model.embed_tokens(torch.tensor([VOCAB]))


def _weight_only(llm: LLM) -> NativeDecodeStep:
    """Every int8 projection weight-only at every row count (bitwise the layer loop's; W8A8 is within 1e-5), and the
    runner's native step rebuilt on that."""
    runner = llm.core.executor
    for layer in runner.model.modules():
        if isinstance(layer, Linear) and layer.cpu_forms is not None and layer.cpu_forms.int8 is not None:
            layer.cpu_forms.int8.w8a8_m = 1 << 62
    runner.decode_step = NativeDecodeStep(runner.model)
    return runner.decode_step


def test_the_native_step_gives_the_layer_loops_bits(tied_int8: LLM) -> None:
    """Greedy generations with the tied int8 table: the native decode step's logprobs are bitwise the layer loop's
    (both read the embedding rows from the head's codes; where the build runs the fused int8 step, it gathers them)."""
    runner = tied_int8.core.executor
    if not isinstance(runner.decode_step, NativeDecodeStep):
        pytest.skip("native CPU kernels unavailable")
    step = _weight_only(tied_int8)
    try:
        assert_native_step_matches_layer_loop(tied_int8, (3, 40, 1, 17, 9), max_tokens=10, tolerance=0.0)
    finally:
        runner.decode_step = step


def test_the_fused_steps_gather_reads_the_codes(tied_int8: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused int8 step (`decode_int8_head`) gathers its rows from the int8 codes in C++: its logits are bitwise
    those of the same call given the float table codes * scale, a scale vector of the wrong length is refused by
    name, and generations through it keep the layer loop's logprobs bitwise."""
    runner = tied_int8.core.executor
    if not isinstance(runner.decode_step, NativeDecodeStep) or runner.decode_step.head is None:
        pytest.skip("the native int8 decode step is unavailable here")
    step = _weight_only(tied_int8)  # so that every decode step can fuse the head
    assert step.head is not None
    embedding = runner.model.embed_tokens
    assert isinstance(embedding, Int8Embedding)
    block = tied_int8.core.config.block_size
    rest = (
        runner.model.rotary.cos,
        runner.model.rotary.sin,
        runner.kv_caches,
        torch.tensor([0, block], dtype=torch.int64),
        torch.tensor([[0], [1]], dtype=torch.int32),
        torch.tensor([1, 1], dtype=torch.int32),
        step.weights,
        step.head,
    )
    ids, positions = torch.tensor([VOCAB - 1, 5]), torch.tensor([0, 0])
    widened = embedding.codes.float() * embedding.scale[:, None]
    from_codes, _ = cpu_kernels.decode_int8_head(ids, positions, embedding.codes, embedding.scale, *rest, greedy=False)
    from_floats, _ = cpu_kernels.decode_int8_head(ids, positions, widened, None, *rest, greedy=False)
    assert torch.isfinite(from_codes).all() and torch.equal(from_codes, from_floats)
    with pytest.raises(RuntimeError, match="one per row of the int8 table"):
        cpu_kernels.decode_int8_head(ids, positions, embedding.codes, embedding.scale[1:], *rest, greedy=False)

    calls: list[bool] = []
    kernel = cpu_kernels.decode_int8_head

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(True)
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "decode_int8_head", counted)
    assert_native_step_matches_layer_loop(tied_int8, (3, 40, 1, 17, 9), max_tokens=10, tolerance=0.0)
    assert calls  # the native runs gathered from the codes in the fused kernel


def test_an_untied_int8_embedding_stays_float32(tmp_path: Path, smollm2_dir: str) -> None:
    """Not a linear weight (vLLM keeps embeddings unquantized): its own table, float32, and the head its own codes."""
    model_dir = _tiny("llama", tmp_path / "untied", smollm2_dir)
    model = _model(LLM(str(model_dir), quantization="int8", kv_cache_memory=0.05))
    assert isinstance(model.embed_tokens, Embedding) and model.embed_tokens.weight.dtype == torch.float32
    head = model.lm_head.cpu_forms
    assert head is not None and head.int8 is not None and model.lm_head.weight is None
    table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, table)
