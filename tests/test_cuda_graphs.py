"""CUDA-graph decode steps: bucketing and padding on CPU (through the real Triton backend, interpreted); capture and
replay themselves need CUDA and are skipped here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_core.attention.backend import AttentionMetadata
from engine_core.attention.triton_backend import TritonAttentionBackend
from engine_core.worker.cuda_graphs import CudaGraphDecodeStep, bucket_for, capture_sizes
from engine_core.worker.device_inputs import DeviceInputs, InputSpec

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
        if persistent:  # fixed tensors: rows must have their width (on CPU a step's tables are as wide as it needs)
            with pytest.raises(ValueError, match="decode_block_tables: rows of shape"):
                inputs.put("decode_block_tables", np.zeros((2, 5), dtype=np.int32))
    # Persistent: the same storage every step (what a graph captured).
    inputs = DeviceInputs(torch.device("cpu"), _specs(8, 4), persistent=True)
    a = inputs.put("positions", np.arange(3), pad_to=4)
    inputs.put("positions", np.arange(10, 12), pad_to=4)
    assert a.tolist() == [10, 11, 0, 0] and a.data_ptr() == inputs._dev["positions"].data_ptr()


def _eager_meta(lens: np.ndarray, tables: np.ndarray, slots: np.ndarray, width: int) -> AttentionMetadata:
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return AttentionMetadata(
        num_decodes=len(lens),
        num_prefills=0,
        slot_mapping=torch.from_numpy(slots).to(DEVICE),
        decode_seq_lens=torch.from_numpy(lens).to(DEVICE),
        decode_block_tables=torch.from_numpy(tables[:, :width]).to(DEVICE),  # as wide as the step needs
        max_decode_seq_len=int(lens.max()),
        prefill_query_start_loc=torch.zeros(1, **i32),
        prefill_seq_lens=torch.zeros(0, **i32),
        prefill_block_tables=torch.zeros(0, 1, **i32),
        max_prefill_query_len=0,
        prefill_query_lens_cpu=[],
        prefill_seq_lens_cpu=[],
    )


def test_padded_bucket_equals_the_unpadded_step() -> None:
    """A decode step of 3 sequences copied into the graph step's static buffers (bucket 4, fixed split count) and
    run through the Triton backend over its static metadata: the 3 real rows equal the eager step's, the padding
    row is zeros and writes no K/V."""
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
    meta = _eager_meta(lens, tables, slots, width=3)
    eager = backend.forward(q[:3], k[:3], v[:3], eager_cache, meta)

    def no_forward(*_: object) -> torch.Tensor:
        raise AssertionError("fill only")

    step = CudaGraphDecodeStep(no_forward, capture_sizes(8), max_blocks, 2048, lambda _: 4, DEVICE)
    step.seq_lens.fill_(99)  # stale rows from an earlier, larger step must be padded over
    ids, pos = torch.tensor([11, 12, 13], device=DEVICE), torch.tensor([39, 0, 16], device=DEVICE)
    size = step.fill(ids, pos, meta)
    assert size == 4
    assert step.input_ids[:3].tolist() == [11, 12, 13] and step.positions[:3].tolist() == [39, 0, 16]
    static = step.static_metadata(size)
    assert static.decode_num_splits == 4 and static.decode_block_tables.shape == (4, max_blocks)
    graph_cache = kv_cache.clone()
    padded = backend.forward(q, k, v, graph_cache, static)

    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    assert not padded[3].any()
    assert torch.equal(graph_cache, eager_cache), "the padding row wrote K/V, or a real row wrote elsewhere"
    # Larger than every bucket: no bucket (the step function then runs the eager forward).
    big = _eager_meta(np.ones(9, dtype=np.int32), np.zeros((9, 1), dtype=np.int32), np.zeros(9, dtype=np.int64), 1)
    assert step.fill(torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64), big) is None


@pytest.mark.skipif(not CUDA, reason="CUDA graph capture needs a CUDA device")
def test_capture_and_replay_match_eager() -> None:
    """On CUDA only: a captured toy forward replays with each step's new inputs, padded to its bucket."""
    weight = torch.randn(16, device=DEVICE)
    kv_caches = [torch.zeros(1, device=DEVICE)]

    def forward(ids: torch.Tensor, pos: torch.Tensor, kv: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return weight[ids % 16] * (pos + meta.decode_seq_lens).float()

    step = CudaGraphDecodeStep(forward, capture_sizes(8), 4, 64, lambda _: 1, DEVICE)
    step.capture(kv_caches)
    for n in (3, 1, 8):
        ids = torch.randint(0, 100, (n,), device=DEVICE)
        pos = torch.randint(0, 50, (n,), device=DEVICE)
        lens = np.random.default_rng(n).integers(1, 60, n).astype(np.int32)
        meta = _eager_meta(lens, np.zeros((n, 4), dtype=np.int32), np.full(n, -1), 4)
        torch.testing.assert_close(step(ids, pos, kv_caches, meta), forward(ids, pos, kv_caches, meta))


def test_cuda_defaults_bfloat16_and_graphs_cpu_stays_float32() -> None:
    from engine_core.config import EngineConfig

    assert EngineConfig(device="cuda").resolved_dtype == "bfloat16"
    assert EngineConfig(device="cuda:1").resolved_dtype == "bfloat16"
    assert EngineConfig().resolved_dtype == "float32"  # device cpu
    assert EngineConfig(device="cuda", dtype="float16").resolved_dtype == "float16"
    assert EngineConfig().enforce_eager is False  # graphs on wherever they apply (CUDA + triton backend)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int8")
