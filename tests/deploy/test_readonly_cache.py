"""Baked kernels load from a read-only PAGODA_CACHE: no compiler, no write (the container's readOnlyRootFilesystem)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kernels import cpu


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_prebuilt_kernels_load_without_writing_or_a_compiler(tmp_path: Path) -> None:
    assert cpu.available(), "make test builds the kernels first (`python -m kernels.cpu`)"
    # NOTE: a private copy of the cache: other processes on this machine load (and touch) the shared one.
    build_dir = cpu._build_dir()
    cache = tmp_path / "cache"
    copy = cache / build_dir.relative_to(build_dir.parent.parent)
    shutil.copytree(build_dir, copy, ignore=shutil.ignore_patterns("lock"))
    before = _snapshot(cache)
    # NOTE: no compiler on PATH and none named by CXX/CC: loading must not need one.
    env = {**os.environ, "PAGODA_CACHE": str(cache), "PATH": str(Path(sys.executable).parent)}
    env.update(CXX="/nonexistent", CC="/nonexistent")
    code = "from kernels import cpu; import torch; assert cpu.available(); print(torch.ops.pagoda_cpu.store_kv)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unavailable" not in out.stderr
    assert _snapshot(cache) == before
