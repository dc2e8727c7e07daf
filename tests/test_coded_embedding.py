"""A tied embedding read from the LM head's block codes: every row the float32 table's bits, in every record layout;
the default model keeps its table once (as codes)."""

from __future__ import annotations

import pytest
import torch

from engine_core.model.gguf_kquants import KQUANTS, unpack_kquant
from engine_core.model.layers.coded_embedding import CodedEmbedding
from kernels import cpu as cpu_kernels
from kernels.reference import ref_gguf_decoded
from tests.test_kquant_codes import kquant_bytes

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ toolchain for the native CPU kernels")
VOCAB, DIM = 200, 512  # 200 rows: a partial last panel of 16


def _tables() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each layout's (float32 table, records)."""
    gen = torch.Generator().manual_seed(9)
    out = {}
    for kind in ("q8_0", "q4_1"):
        table = ref_gguf_decoded(torch.randn(VOCAB, DIM, generator=gen) * 0.05, kind)
        records = cpu_kernels.coded_pack(table)
        assert records is not None
        out[kind] = (table, records)
    for kind in KQUANTS:
        codes = unpack_kquant(kind, kquant_bytes(kind, VOCAB, DIM, gen, 1e-3).reshape(-1), (VOCAB, DIM))
        out[kind.name] = (codes.values(), codes.records())
    return out


@pytest.mark.parametrize("layout", ["q8_0", "q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_rows_gathered_from_codes_are_the_tables_rows(layout: str) -> None:
    table, records = _tables()[layout]
    embedding = CodedEmbedding(records, VOCAB, DIM)
    ids = torch.tensor([0, 15, 16, 17, 199, 3, 3, 128])
    got = embedding(ids)
    assert got.shape == (8, DIM) and got.dtype == torch.float32
    assert torch.equal(got, table[ids])
    assert torch.equal(embedding(torch.arange(VOCAB)), table)  # every row, the padded last panel's included
    assert embedding(ids.view(2, 4)).shape == (2, 4, DIM)


@pytest.mark.slow
@pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.coded_linear_vectorized()),
    reason="no vectorized coded kernel: the model runs float32 and keeps no codes (CpuGemmRows.for_this_cpu)",
)
def test_the_default_model_keeps_its_tied_table_once_as_codes() -> None:
    """SmolLM2's tied Q8_0 table: the embedding gathers from the LM head's records (no float32 table resident), and
    its rows are the file's decoded rows, bit for bit."""
    from engine_core import LLM
    from engine_core.checkpoint.model_files import default_model_path
    from engine_core.model.gguf_weights import iter_gguf_weights

    llm = LLM(kv_cache_memory=0.02, num_threads=2)
    model = llm.core.executor.model
    assert isinstance(model.embed_tokens, CodedEmbedding)
    forms = model.lm_head.cpu_forms
    assert forms is not None and model.embed_tokens.records is forms.coded
    assert all(p.numel() < 1 << 20 for p in model.parameters())  # norms only: no [vocab, hidden] table
    cfg = model.config
    table = dict(iter_gguf_weights(default_model_path(), cfg.num_attention_heads, cfg.num_key_value_heads))[
        "model.embed_tokens.weight"
    ]
    assert isinstance(table, torch.Tensor)
    assert torch.equal(model.embed_tokens(torch.arange(cfg.vocab_size)), table)
