"""Kernel tests: on CUDA tensors with compiled kernels where a GPU is visible, else through the Triton interpreter on
CPU tensors. The interpreter-or-compiled choice is made once, by `kernels.triton_mode` (tests/conftest.py calls it
before anything imports triton); the device follows from the same condition.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kernels.triton_mode import configure_triton_interpret

INTERPRETED = configure_triton_interpret()
# NOTE: the kernels' tensors must live where the kernels run: CUDA when compiled, CPU when interpreted.
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# fp16 only on a GPU: the interpreter is slow, and its fp32-dot path makes fp16 no different from bf16 there.
CASE_DTYPES = [torch.float32, torch.bfloat16] if INTERPRETED else [torch.float32, torch.bfloat16, torch.float16]
DTYPES = [pytest.param(dt, id=DTYPE_IDS[dt]) for dt in CASE_DTYPES]
# GQA groups of the attention kernels' case products. NOTE: interpreted, 1 and 3 (a lone head; a group that is not a
# power of two, so the decode kernel's padded head rows are masked): 4 and 8 take no other path through either kernel
# (decode pads every group below 16 to a 16-row tile; prefill runs one program per query head, so its cost grows
# with the group), and the query-to-KV-head mapping is the several-KV-head tests'. Compiled, every group.
CASE_GROUPS = [1, 3] if INTERPRETED else [1, 3, 4, 8]

# Stated tolerances (atol, rtol) against fp32 torch references computed from the same (rounded) inputs. bf16 outputs
# are rounded to bf16 (2^-9 relative) and attention also rounds P to bf16 before P @ V, hence the 2e-2.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (1e-2, 1e-2),  # 2^-11 relative step: 4x finer than bf16
}

# Per (kernel, dtype): worst abs error, and worst fraction of the allowed `atol + rtol * |expected|` used (1.0 = at
# the limit); printed at the end of the run.
_WORST: dict[tuple[str, str], tuple[float, float]] = defaultdict(lambda: (0.0, 0.0))


def assert_close(kernel: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`|actual - expected| <= atol + rtol * |expected|` elementwise (fp32 comparison), and record the worst error."""
    atol, rtol = TOLERANCES[dtype]
    a, e = actual.float().cpu(), expected.float().cpu()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.isfinite(a).all(), f"{kernel}: non-finite output"
    err = (a - e).abs()
    if err.numel():
        key = (kernel, str(dtype).removeprefix("torch."))
        usage = (err / (atol + rtol * e.abs())).max().item()
        _WORST[key] = (max(_WORST[key][0], err.max().item()), max(_WORST[key][1], usage))
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _WORST:
        return
    terminalreporter.write_sep("-", "kernel accuracy: worst abs error, worst fraction of the tolerance used")
    for (kernel, dtype), (abs_err, usage) in sorted(_WORST.items()):
        terminalreporter.write_line(f"{kernel:<20} {dtype:<9} abs {abs_err:.2e}  tolerance used {usage:.1%}")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_paged_cache(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, spare_blocks: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random `[2, num_blocks, block_size, kv_heads, head_dim]` cache and `[len(seq_lens), max_blocks]` int32 block
    tables that give each sequence enough distinct blocks, shuffled over the whole cache (so they are neither
    contiguous nor ordered). Every slot holds random data, so reading a wrong block shows; table entries past a
    sequence's last block are -1, so dereferencing one reads out of bounds."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq, default=0) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return kv_cache, tables.to(DEVICE)


def make_cpu_paged_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the native CPU kernels, drawn from `gen`: a random float32 CPU cache and block tables whose blocks are
    shuffled over the whole cache; entries past a sequence's last block are -1 (reading one fails the kernel's range
    check)."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(per_seq, default=0) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[used : used + n].int()
        used += n
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen), tables


def boundary_lengths(block_size: int) -> list[int]:
    """Context lengths around block boundaries: 1, a full block, one past it, two blocks and a bit."""
    return [1, block_size, block_size + 1, 2 * block_size + 3]
