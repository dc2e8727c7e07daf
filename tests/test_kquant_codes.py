"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as their codes: decoded bit for bit as gguf-py decodes them, multiplied by
`coded_linear` at every row count with the panel kernel's bits, and a K-quant model's greedy tokens are transformers'
float32 decoding of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, get_tensor_name_map
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from engine_core import LLM, SamplingParams
from engine_core.checkpoint.gguf_file import GgufTensor
from engine_core.checkpoint.model_dir import GGUF_LINK, transformers_kwargs
from engine_core.model.gguf_kquants import KQUANTS, unpack_kquant
from engine_core.model.gguf_weights import decode
from engine_core.model.layers.block_codes import cat_rows
from engine_core.model.layers.cpu_gemm_rows import CODED_M, NEVER, ONEDNN_M, CpuGemmRows
from engine_core.model.layers.gguf_codes import GgufCodesMethod
from engine_core.model.layers.linear import Linear
from kernels import cpu as cpu_kernels
from tests.gguf_writer import finish, gguf_writer, llama_qk_heads, permute_qk
from tests.hf_reference import hf_greedy
from tests.test_gguf_weights import ARCHS

Q = GGMLQuantizationType
KINDS = list(KQUANTS)
native = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()), reason="no vectorized coded kernel"
)


def kquant_bytes(kind: Q, rows: int, cols: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Valid `kind` blocks for a `[rows, cols]` tensor: random codes and sub-block scales, finite f16 super-block
    scales around `scale` (either sign), as uint8 `[rows, cols / 256 * block_bytes]`."""
    block_bytes = KQUANTS[kind]
    n = rows * cols // 256
    raw = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=gen)

    def f16(size: float) -> torch.Tensor:
        return (torch.randn(n, generator=gen) * size).half().view(torch.uint8).view(n, 2)

    if kind == Q.Q6_K:
        raw[:, 208:210] = f16(scale)
    else:
        raw[:, 0:2], raw[:, 2:4] = f16(scale), f16(scale)
    return raw.view(rows, -1)


def reference(kind: Q, raw: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.numpy(), kind).copy())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_values_are_gguf_pys_decoding_bit_for_bit(kind: Q) -> None:
    """Scales of every size (subnormal f16 to 1e3) and sign; -0.0 and +0.0 told apart."""
    gen = torch.Generator().manual_seed(3)
    for scale in (1e-6, 1e-2, 1e3):
        raw = kquant_bytes(kind, 48, 512, gen, scale)
        want = reference(kind, raw)
        codes = unpack_kquant(kind, raw.reshape(-1), (48, 512))
        assert torch.equal(codes.values().view(torch.int32), want.view(torch.int32))
        tensor = GgufTensor("blk.0.ffn_up.weight", (48, 512), kind, 0, raw.numel())
        assert torch.equal(decode(tensor, raw.reshape(-1)).view(torch.int32), want.view(torch.int32))
    assert raw.shape[1] == 512 // 256 * GGML_QUANT_SIZES[kind][1]


@native
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40, 129])
@pytest.mark.parametrize(("n", "with_bias"), [(64, False), (40, True)])
def test_coded_linear_on_kquant_records_gives_the_panel_kernels_bits(
    kind: Q, rows: int, n: int, with_bias: bool
) -> None:
    """Every row-block height, panels decoded once from 16 rows, a partial last panel: the records hold the weights
    gguf-py decodes, and the product is the panel kernel's on them (one FMA chain per output), within float32
    rounding of a float64 matmul."""
    gen = torch.Generator().manual_seed(rows * 7 + n)
    raw = kquant_bytes(kind, n, 768, gen, scale=1e-3)
    w = reference(kind, raw)
    records = unpack_kquant(kind, raw.reshape(-1), (n, 768)).records()
    assert torch.equal(cpu_kernels.coded_linear(torch.eye(768), records, n, None).T, w)
    x = torch.randn(rows, 768, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_kernels.coded_linear(x, records, n, b)
    assert torch.equal(got, cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), n, b))
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@native
@pytest.mark.parametrize(
    ("kinds", "layout"),
    [
        ((Q.Q4_K, Q.Q4_K, Q.Q4_K), (384,)),
        ((Q.Q4_K, Q.Q5_K, Q.Q5_K), (640,)),
        ((Q.Q6_K, Q.Q6_K, Q.Q6_K), (2, 384)),
        ((Q.Q4_K, Q.Q5_K, Q.Q6_K), (2, 384)),  # llama.cpp's Q4_K_M: a Q6_K v beside Q4_K q / k
    ],
    ids=lambda v: "-".join(k.name for k in v) if isinstance(v[0], Q) else str(v),
)
def test_a_fused_kquant_linear_keeps_its_codes_alone(kinds: tuple[Q, ...], layout: tuple[int, ...]) -> None:
    """Q, K, V shards stacked into one set of records, in the narrowest layout all of them fit (mixed kinds
    widened exactly), and nothing else resident: the float32 weights' panel-kernel bits at decode and prefill rows."""
    gen = torch.Generator().manual_seed(4)
    sizes = [32, 16, 16]
    codes = [
        unpack_kquant(k, kquant_bytes(k, r, 256, gen, 1e-3).reshape(-1), (r, 256))
        for k, r in zip(kinds, sizes, strict=True)
    ]
    layer = Linear(256, 64, bias=False, output_sizes=sizes)
    for shard, c in enumerate(codes):
        layer.weight_loader(layer.weight, c.values(), shard, c)
    w = torch.cat([c.values() for c in codes])
    assert torch.equal(cat_rows(codes).values(), w)
    layer.process_weights(GgufCodesMethod(CpuGemmRows(CODED_M, ONEDNN_M, NEVER)))
    forms = layer.cpu_forms
    assert forms is not None and forms.coded is not None and (forms.panels, forms.onednn, forms.plain) == (None,) * 3
    assert tuple(forms.coded.shape[2:]) == layout
    assert layer.block_codes == [None, None, None]  # the loaded codes are not kept beside the records
    for rows in (1, 20):
        x = torch.randn(rows, 256, generator=gen)
        assert torch.equal(layer(x), cpu_kernels.panel_linear(x, cpu_kernels.panel_pack(w), 64, None))


def _write_kquant_gguf(path: Path, model: torch.nn.Module, gen: torch.Generator) -> dict[str, Q]:
    """`model`'s layout in a Llama GGUF file whose matrices are random K-quant blocks (each kind in turn; the output
    matrix Q6_K as llama.cpp writes it); the model's own values are not used, only its names and shapes."""
    cfg = model.config
    writer = gguf_writer(path, "llama", cfg)
    names = get_tensor_name_map(ARCHS["llama"], cfg.num_hidden_layers)
    kinds: dict[str, Q] = {}
    for i, (hf, tensor) in enumerate(model.state_dict().items()):
        base, suffix = hf.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if tensor.dim() == 1:
            writer.add_tensor(name, tensor.numpy())
            continue
        kind = Q.Q6_K if name == "output.weight" else KINDS[i % len(KINDS)]
        raw = kquant_bytes(kind, tensor.shape[0], tensor.shape[1], gen, scale=2e-3).numpy()
        heads = llama_qk_heads(name, cfg)
        if heads is not None:  # rows as llama.cpp stores them (the loader undoes this, for codes and values alike)
            raw = permute_qk(raw, heads)
        writer.add_tensor(name, raw, raw_dtype=kind)
        kinds[hf] = kind
    finish(writer)
    return kinds


@native
@pytest.mark.slow
def test_a_kquant_gguf_model_gives_transformers_greedy_tokens(tmp_path: Path, smollm2_dir: str) -> None:
    """A Llama GGUF of Q4_K / Q5_K / Q6_K matrices (K = 256 and 512): every projection computes from its codes alone,
    and prefill (past 16 rows) then decode give transformers' float32 greedy tokens for the same file."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    kinds = _write_kquant_gguf(tmp_path / GGUF_LINK, model, gen)
    assert set(kinds.values()) == set(KINDS)
    config.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **transformers_kwargs(tmp_path)).eval()
    llm = LLM(str(tmp_path), kv_cache_memory=0.05, enable_prefix_caching=False)
    linears = [m for m in llm.core.executor.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1
    for layer in linears:
        forms = layer.cpu_forms
        assert forms is not None and forms.coded is not None and forms.panels is None and forms.onednn is None
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (40, 5)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 8)
