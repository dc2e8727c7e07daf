"""The worker's allocator settings: memory a step frees is reused, not handed back to the kernel and faulted in again.

Each case runs in a fresh interpreter: the settings are process-wide and must precede the allocations they govern."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Allocates and writes a 64 MiB tensor (above glibc's largest dynamic mmap threshold, 32 MiB) and frees it, 3 times,
# on a thread as the worker's steps run; prints the page faults of the last round.
PROBE = """
import resource, sys, threading, torch
from engine_core.host_allocator import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
faults = []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
        del x
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=rounds)
t.start()
t.join()
print(faults[-1])
"""
PAGES = (64 << 20) // 4096


def last_round_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_instead_of_faulted_in_again() -> None:
    # NOTE: the default run is the control: it shows the probe can fail (glibc unmaps the chunk on every free)
    assert last_round_faults("default") > PAGES // 2
    assert last_round_faults("retain") < PAGES // 16
