"""CUDA-graph decode steps: bucketing and padding on CPU (through the real Triton backend, interpreted); capture and
replay themselves need CUDA and are skipped here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.triton_backend import TritonAttentionBackend
from engine_core.cuda_graphs import CudaGraphDecode, bucket_for, capture_sizes, graph_metadata
from engine_core.device_inputs import DeviceInputs, InputSpec

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(128)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 128 and all(s % 8 == 0 for s in sizes[3:])
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (17, 20), (20, 20), (21, None)])
def test_bucket_for(n: int, bucket: int | None) -> None:
    assert bucket_for(n, capture_sizes(20)) == bucket


def _specs(rows: int, max_blocks: int) -> list[InputSpec]:
    return [
        InputSpec("input_ids", torch.int64, (rows,)),
        InputSpec("positions", torch.int64, (rows,)),
        InputSpec("slot_mapping", torch.int64, (rows,)),
        InputSpec("decode_seq_lens", torch.int32, (rows,)),
        InputSpec("decode_block_tables", torch.int32, (rows, max_blocks)),
    ]


def test_device_inputs_pad_and_check_sizes() -> None:
    for persistent in (False, True):
        inputs = DeviceInputs(torch.device("cpu"), _specs(8, 4), persistent=persistent)
        t = inputs.put("slot_mapping", np.array([5, 6, 7]), pad_to=4, pad_value=-1)
        assert t.tolist() == [5, 6, 7, -1]
        tables = inputs.put("decode_block_tables", np.ones((2, 4), dtype=np.int32), pad_to=3)
        assert tables.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
        with pytest.raises(ValueError, match="slot_mapping: 9 rows"):
            inputs.put("slot_mapping", np.zeros(9, dtype=np.int64))
        with pytest.raises(ValueError, match="decode_block_tables: rows of shape"):
            inputs.put("decode_block_tables", np.zeros((2, 5), dtype=np.int32))
    # Persistent: the same storage every step (what a graph captured).
    inputs = DeviceInputs(torch.device("cpu"), _specs(8, 4), persistent=True)
    a = inputs.put("positions", np.arange(3), pad_to=4)
    inputs.put("positions", np.arange(10, 12), pad_to=4)
    assert a.tolist() == [10, 11, 0, 0] and a.data_ptr() == inputs.device_tensor("positions").data_ptr()


def test_padded_bucket_equals_the_unpadded_step() -> None:
    """A decode step of 3 sequences run as bucket 4 with a fixed split count, through graph_metadata over the
    persistent inputs: the 3 real rows equal the eager step's, the padding row is zeros and writes no K/V."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, max_blocks = 4, 2, 16, 16, 8
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, block_size, head_dim**-0.5)
    lens = np.array([40, 1, 17], dtype=np.int32)
    tables = np.stack([np.random.default_rng(i).permutation(24)[:max_blocks] for i in range(3)]).astype(np.int32)
    slots = np.array([tables[i, (n - 1) // block_size] * block_size + (n - 1) % block_size for i, n in enumerate(lens)])
    kv_cache = torch.randn(2, 24, block_size, num_kv_heads, head_dim, device=DEVICE)
    q = torch.randn(4, num_heads, head_dim, device=DEVICE)
    k = torch.randn(4, num_kv_heads, head_dim, device=DEVICE)
    v = torch.randn(4, num_kv_heads, head_dim, device=DEVICE)

    eager_cache = kv_cache.clone()
    i32 = {"dtype": torch.int32, "device": DEVICE}
    eager_meta = AttentionMetadata(
        num_decodes=3,
        num_prefills=0,
        slot_mapping=torch.from_numpy(slots).to(DEVICE),
        decode_seq_lens=torch.from_numpy(lens).to(DEVICE),
        decode_block_tables=torch.from_numpy(tables[:, :3]).to(DEVICE),  # as wide as the step needs
        max_decode_seq_len=40,
        prefill_query_start_loc=torch.zeros(1, **i32),
        prefill_seq_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.zeros(0, 1, **i32),
        max_prefill_query_len=0,
        prefill_query_lens_cpu=[],
        prefill_seq_lens_cpu=[],
    )
    eager = backend.forward(q[:3], k[:3], v[:3], eager_cache, eager_meta)

    inputs = DeviceInputs(DEVICE, _specs(8, max_blocks), persistent=True)
    size = bucket_for(3, capture_sizes(8))
    assert size == 4
    inputs.begin()
    inputs.put("slot_mapping", slots, pad_to=size, pad_value=-1)
    inputs.put("decode_seq_lens", lens, pad_to=size)
    inputs.put("decode_block_tables", tables, pad_to=size)
    inputs.end()
    meta = graph_metadata(inputs, size, max_seq_len=2048, num_splits=4)
    graph_cache = kv_cache.clone()
    padded = backend.forward(q, k, v, graph_cache, meta)

    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert not padded[3].any()
    assert torch.equal(graph_cache, eager_cache), "the padding row wrote K/V, or a real row wrote elsewhere"


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device")
def test_capture_and_replay_match_eager() -> None:
    """On CUDA only: a captured toy forward over the persistent inputs replays with new inputs correctly."""
    inputs = DeviceInputs(DEVICE, _specs(8, 4))
    weight = torch.randn(16, device=DEVICE)

    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return weight[ids % 16] * (pos + meta.decode_seq_lens).float()

    graphs = CudaGraphDecode(forward, inputs, capture_sizes(8), max_seq_len=64, num_splits=lambda _: 1)
    graphs.capture()
    ids, pos, lens = np.array([3, 5, 7]), np.array([10, 2, 0]), np.array([11, 3, 1], dtype=np.int32)
    inputs.begin()
    inputs.put("input_ids", ids, pad_to=4)
    inputs.put("positions", pos, pad_to=4)
    inputs.put("decode_seq_lens", lens, pad_to=4)
    inputs.end()
    out = graphs.replay(4, 3)
    expected = weight[torch.from_numpy(ids).to(DEVICE) % 16] * torch.from_numpy(pos + lens).to(DEVICE).float()
    torch.testing.assert_close(out, expected)
