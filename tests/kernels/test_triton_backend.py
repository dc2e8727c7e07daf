"""The `triton` backend on a full metadata-driven batch, against attention computed from each sequence's contiguous
K/V history (no paging, no code shared with the kernels or kernels.reference)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.selector import create_backend
from engine_core.attention.triton_backend import TritonAttentionBackend
from kernels import choose_num_splits
from tests.kernels.conftest import DEVICE, DTYPES, assert_close


def _expected_attention(
    q: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor, scale: float
) -> torch.Tensor:  # fp32 [qlen, H, D]
    """The last `qlen` positions of a sequence attend causally over its whole history `[seq_len, KVH, D]`."""
    qlen, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k_hist.shape
    group = num_heads // num_kv_heads
    k = k_hist.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]
    v = v_hist.float().repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [qlen, seq_len]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _run_batch(
    decode_lens: list[int],  # context length including the new token
    chunks: list[tuple[int, int]],  # (cached context, chunk length)
    num_padding: int,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    backend_name: str = "triton",
) -> None:
    num_heads = num_kv_heads * group
    scale = head_dim**-0.5
    # (total length, new tokens) per sequence, decodes first, as the batch lays them out.
    seqs = [(n, 1) for n in decode_lens] + [(ctx + qlen, qlen) for ctx, qlen in chunks]
    blocks_per_seq = [-(-total // block_size) for total, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    expected_cache = kv_cache.clone()

    qs, ks, vs, slots, expected = [], [], [], [], []
    for i, ((total, new), nblk) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        tables[i, :nblk] = torch.tensor(perm[:nblk], dtype=torch.int32)
        perm = perm[nblk:]
        k_hist = torch.randn(total, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v_hist = torch.randn(total, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
        for pos in range(total):
            block, off = int(tables[i, pos // block_size]), pos % block_size
            expected_cache[:, block, off] = torch.stack([k_hist[pos], v_hist[pos]])
            if pos < total - new:  # earlier steps already cached this token
                kv_cache[:, block, off] = expected_cache[:, block, off]
            else:
                slots.append(block * block_size + off)
        q = torch.randn(new, num_heads, head_dim, dtype=dtype, device=DEVICE)
        qs.append(q)
        ks.append(k_hist[total - new :])
        vs.append(v_hist[total - new :])
        expected.append(_expected_attention(q, k_hist, v_hist, scale))

    # Padding tokens at the end of the batch: slot -1, never written, output rows zero.
    qs.append(torch.randn(num_padding, num_heads, head_dim, dtype=dtype, device=DEVICE))
    ks.append(torch.randn(num_padding, num_kv_heads, head_dim, dtype=dtype, device=DEVICE))
    vs.append(torch.randn(num_padding, num_kv_heads, head_dim, dtype=dtype, device=DEVICE))
    slots += [-1] * num_padding
    expected.append(torch.zeros(num_padding, num_heads, head_dim, device=DEVICE))

    nd = len(decode_lens)
    qlens = [qlen for _, qlen in chunks]
    i32 = {"dtype": torch.int32, "device": DEVICE}
    meta = AttentionMetadata(
        num_decodes=nd,
        num_prefills=len(chunks),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        decode_seq_lens=torch.tensor(decode_lens, **i32),
        decode_block_tables=tables[:nd].to(DEVICE),
        max_decode_seq_len=max(decode_lens, default=0),
        prefill_query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], **i32),
        prefill_seq_lens=torch.tensor([ctx + qlen for ctx, qlen in chunks], **i32),
        prefill_block_tables=tables[nd:].to(DEVICE),
        max_prefill_query_len=max(qlens, default=0),
        prefill_query_lens_cpu=qlens,
        prefill_seq_lens_cpu=[ctx + qlen for ctx, qlen in chunks],
    )
    backend = create_backend(backend_name, num_heads, num_kv_heads, head_dim, block_size, scale)
    assert backend.name == backend_name
    assert isinstance(backend, TritonAttentionBackend) == (backend_name == "triton")
    # q as a strided view into a wider buffer, the way a fused qkv projection hands it over.
    q_all = torch.cat(qs)
    q_view = torch.cat([q_all, q_all[:, :1]], dim=1)[:, :num_heads]
    backend.prepare(meta)
    out = backend.forward(q_view, torch.cat(ks), torch.cat(vs), kv_cache, meta)

    assert out.shape == q_all.shape and out.dtype == dtype
    assert torch.equal(kv_cache, expected_cache), "new K/V not in their slots, or another slot was touched"
    assert_close(f"{backend_name}_backend", out, torch.cat(expected), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim"),
    [(16, 2, 4, 64), (32, 1, 3, 128), (16, 1, 1, 128), (32, 2, 8, 64)],
)
def test_mixed_batch(dtype: torch.dtype, block_size: int, num_kv_heads: int, group: int, head_dim: int) -> None:
    bs = block_size
    decode_lens = [1, bs, bs + 1, 2 * bs + 3]
    # A fresh prefill, an extend whose context ends mid-block, an extend of one token, a chunk spanning blocks.
    chunks = [(0, 5), (bs + 3, 2 * bs), (2 * bs, 1), (7, bs + 2)]
    _run_batch(decode_lens, chunks, 3, block_size, num_kv_heads, group, head_dim, dtype)


def test_decodes_only_with_split_k() -> None:
    # max_decode_seq_len >= 512 with 2 x 2 programs: the split-K heuristic kicks in inside the backend.
    assert choose_num_splits(2, 2, 600) > 1
    _run_batch([600, 37], [], 0, 16, 2, 4, 64, torch.float32)


def test_prefills_only() -> None:
    _run_batch([], [(0, 40), (20, 9)], 2, 16, 2, 2, 64, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_backend_same_contract(dtype: torch.dtype) -> None:
    """The CPU backend meets the same contract; 20 decode rows of mixed lengths exercise its length groups."""
    torch.manual_seed(0)
    decode_lens = torch.randint(1, 120, (20,)).tolist()
    _run_batch(decode_lens, [(0, 5), (19, 32), (32, 1)], 2, 16, 2, 3, 64, dtype, backend_name="torch")


@pytest.mark.parametrize("head_dim", [64, 48])  # 48 is not a multiple of 32: the kernel's portable (non-AVX2) loops
@pytest.mark.parametrize("decodes_only", [False, True], ids=["mixed", "decodes-only"])
def test_cpu_backend_same_contract(head_dim: int, decodes_only: bool) -> None:
    """The native CPU backend (float32): decode rows through its kernel, including the copy-free decode-only path."""
    torch.manual_seed(0)
    decode_lens = torch.randint(1, 120, (20,)).tolist()
    chunks = [] if decodes_only else [(0, 5), (19, 32), (32, 1)]
    padding = 0 if decodes_only else 2
    _run_batch(decode_lens, chunks, padding, 16, 2, 3, head_dim, torch.float32, backend_name="cpu")
