"""Kernel tests: on a machine without CUDA they run through the Triton interpreter on CPU tensors.

NOTE: whether kernels are interpreted is decided once, by kernels.triton_mode.configure_triton_interpret, which
tests/conftest.py and kernels/__init__.py both call before triton is imported.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
DTYPES = [pytest.param(dt, id=name) for dt, name in DTYPE_IDS.items()]

# Stated tolerances (atol, rtol) against fp32 torch references computed from the same (rounded) inputs. bf16 outputs
# are rounded to bf16 (2^-9 relative) and attention also rounds P to bf16 before P @ V, hence the 2e-2.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
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


def boundary_lengths(block_size: int) -> list[int]:
    """Context lengths around block boundaries: 1, a full block, one past it, two blocks and a bit."""
    return [1, block_size, block_size + 1, 2 * block_size + 3]
