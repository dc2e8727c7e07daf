"""CUDA graphs for steps with prefill chunks: token buckets, the prefill tile map and the fixed-grid padding on CPU
(through the real Triton backend, interpreted); capture and replay themselves need CUDA and are skipped here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.triton_backend import TritonAttentionBackend
from engine_core.worker.mixed_graphs import CudaGraphMixedStep, token_buckets
from engine_core.worker.step_functions import pick_step_function
from kernels.triton import prefill_num_tiles, prefill_tile_map

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
I32 = {"dtype": torch.int32, "device": DEVICE}


def test_token_buckets() -> None:
    assert token_buckets(1) == [1]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(2048) == [16, 32, 64, 128, *range(256, 2049, 256)]
    big = token_buckets(8192)
    assert big[-7:] == [2048, 3072, 4096, 5120, 6144, 7168, 8192] and len(big) == 18
    assert token_buckets(5000)[-3:] == [3072, 4096, 5000]
    with pytest.raises(ValueError, match="max_tokens"):
        token_buckets(0)


def test_prefill_tile_map_lists_each_chunks_blocks_in_order() -> None:
    starts = torch.tensor([2, 2, 70, 75, 75], **I32)  # chunk lengths 0, 68, 5, 0 (absolute starts)
    tiles = prefill_tile_map(starts, 6)
    assert tiles.dtype == torch.int32 and tiles.tolist() == [[1, 0], [1, 1], [2, 0], [-1, 0], [-1, 0], [-1, 0]]
    assert (prefill_tile_map(torch.zeros(3, **I32), 4)[:, 0] == -1).all()  # no chunk has a row


def test_prefill_num_tiles_bounds_every_split_of_the_tokens() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens, chunks = int(rng.integers(1, 600)), int(rng.integers(1, 20))
        cuts = np.sort(rng.integers(0, tokens + 1, chunks - 1))
        lens = np.diff(np.concatenate(([0], cuts, [tokens])))
        needed = int(sum(-(-n // 64) for n in lens))
        assert needed <= prefill_num_tiles(tokens, chunks), (lens, needed)
        starts = torch.tensor(np.concatenate(([0], np.cumsum(lens))), **I32)
        tiles = prefill_tile_map(starts, prefill_num_tiles(tokens, chunks))
        assert int((tiles[:, 0] >= 0).sum()) == needed


def _slots(tables: np.ndarray, row: int, positions: range, block_size: int) -> list[int]:
    return [int(tables[row, p // block_size]) * block_size + p % block_size for p in positions]


def test_fixed_grid_step_equals_the_eager_step() -> None:
    """A mixed step (2 decodes, a fresh chunk of 5 and an extend of 3 over 20 cached tokens: 10 tokens) copied into
    the mixed step's static buffers (bucket 16, stale values from an earlier step in them) and run through the
    Triton backend over the fixed-grid metadata: its 10 rows equal the eager step's, the padding rows are zeros and
    the KV cache ends the same."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, bs, width = 4, 2, 16, 16, 4
    backend = TritonAttentionBackend(heads, kv_heads, head_dim, bs, head_dim**-0.5)
    perm = np.random.default_rng(1).permutation(32).astype(np.int32)
    tables = perm[:16].reshape(4, width)  # rows: decode 0, decode 1, chunk A, chunk B (distinct blocks)
    decode_lens, chunk_ctx, chunk_len = [40, 17], [0, 20], [5, 3]
    slots = _slots(tables, 0, range(39, 40), bs) + _slots(tables, 1, range(16, 17), bs)
    slots += _slots(tables, 2, range(0, 5), bs) + _slots(tables, 3, range(20, 23), bs)
    meta = AttentionMetadata(
        num_decodes=2,
        num_prefills=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        decode_seq_lens=torch.tensor(decode_lens, **I32),
        decode_block_tables=torch.from_numpy(tables[:2, :3]).to(DEVICE),  # as wide as the step needs
        max_decode_seq_len=40,
        prefill_query_start_loc=torch.tensor([0, 5, 8], **I32),
        prefill_seq_lens=torch.tensor([c + n for c, n in zip(chunk_ctx, chunk_len, strict=True)], **I32),
        prefill_block_tables=torch.from_numpy(tables[2:, :2]).to(DEVICE),
        max_prefill_query_len=5,
        prefill_query_lens_cpu=chunk_len,
        prefill_seq_lens_cpu=[5, 23],
    )
    kv_cache = torch.randn(2, 32, bs, kv_heads, head_dim, device=DEVICE)
    q = torch.randn(16, heads, head_dim, device=DEVICE)
    k = torch.randn(16, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(16, kv_heads, head_dim, device=DEVICE)
    eager_cache = kv_cache.clone()
    eager = backend.forward(q[:10], k[:10], v[:10], eager_cache, meta)

    def no_forward(*_: object) -> torch.Tensor:
        raise AssertionError("fill only")

    step = CudaGraphMixedStep(
        no_forward, token_buckets(64), 4, width, 2048, lambda _: 2, prefill_tile_map, prefill_num_tiles, DEVICE
    )
    for buf in (step.decode_seq_lens, step.prefill_seq_lens, step.query_start_loc):
        buf.fill_(99)  # stale rows from an earlier, larger step must be padded over
    step.slot_mapping.fill_(3)
    ids, pos = torch.arange(10, device=DEVICE), torch.tensor([39, 16, 0, 1, 2, 3, 4, 20, 21, 22], device=DEVICE)
    assert step.fill(ids, pos, meta) == 16
    assert step.input_ids[:10].tolist() == list(range(10)) and step.slot_mapping[10:16].tolist() == [-1] * 6
    static = step.static_metadata(16)
    assert static.num_decodes == static.num_prefills == 4 and static.decode_num_splits == 2
    assert static.prefill_query_start_loc.tolist() == [2, 7, 10, 10, 10]
    assert static.decode_seq_lens.tolist() == [40, 17, 0, 0]
    graph_cache = kv_cache.clone()
    padded = backend.forward(q, k, v, graph_cache, static)

    torch.testing.assert_close(padded[:10], eager, atol=1e-5, rtol=1e-5)
    assert not padded[10:].any()
    assert torch.equal(graph_cache, eager_cache), "a padding row wrote K/V, or a real row wrote elsewhere"
    # Too many tokens for every bucket: the step function runs the eager forward instead.
    big = dataclasses.replace(meta, slot_mapping=torch.full((65,), -1, device=DEVICE))
    assert step.fill(torch.zeros(65, dtype=torch.int64), torch.zeros(65, dtype=torch.int64), big) is None


def test_pick_step_function_routes_by_the_steps_kind() -> None:
    def forward(*_: object) -> torch.Tensor:
        return torch.zeros(0)

    def decode(*_: object) -> torch.Tensor:
        return torch.zeros(1)

    def mixed(*_: object) -> torch.Tensor:
        return torch.zeros(2)

    z = torch.zeros(0, dtype=torch.int32)

    def meta(nd: int, np_: int, tokens: int) -> AttentionMetadata:
        return AttentionMetadata(nd, np_, torch.zeros(tokens), z, z, 0, z, z, z, 0, [], [])

    assert pick_step_function(forward, decode, meta(3, 0, 3), mixed) is decode
    assert pick_step_function(forward, None, meta(3, 0, 3), mixed) is forward
    assert pick_step_function(forward, decode, meta(3, 1, 9), mixed) is mixed
    assert pick_step_function(forward, decode, meta(0, 2, 9), None) is forward


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device")
def test_capture_and_replay_match_eager() -> None:
    """On CUDA only: a captured toy forward replays with each step's new inputs, padded to its bucket."""
    weight = torch.randn(16, device=DEVICE)
    kv_caches = [torch.zeros(1, device=DEVICE)]

    def forward(ids: torch.Tensor, pos: torch.Tensor, kv: list[torch.Tensor], m: AttentionMetadata) -> torch.Tensor:
        return weight[ids % 16] * pos.float() + m.slot_mapping.float()

    step = CudaGraphMixedStep(forward, [16, 32], 8, 4, 64, lambda _: 1, prefill_tile_map, prefill_num_tiles, DEVICE)
    step.capture(kv_caches)
    for n, nd in ((10, 2), (3, 0), (32, 8)):
        ids = torch.randint(0, 100, (n,), device=DEVICE)
        pos = torch.randint(0, 50, (n,), device=DEVICE)
        slots = torch.randint(0, 1000, (n,), device=DEVICE)
        zeros = torch.zeros(nd, 4, **I32)
        m = AttentionMetadata(
            nd, 1, slots, torch.ones(nd, **I32), zeros, 1, torch.tensor([0, n - nd], **I32),
            torch.tensor([n - nd], **I32), torch.zeros(1, 4, **I32), n - nd, [n - nd], [n - nd],
        )  # fmt: skip
        torch.testing.assert_close(step(ids, pos, kv_caches, m), forward(ids, pos, kv_caches, m))
