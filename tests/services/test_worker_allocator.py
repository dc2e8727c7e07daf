"""The worker applies its allocator settings (engine_core/worker/host_allocator.py) before it loads the model."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from services.launcher import LocalCluster


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_worker_keeps_freed_memory_from_before_the_model_load(cluster: LocalCluster) -> None:
    log = Path(cluster.config.log_dir or "") / "worker0.log"
    events = [json.loads(line).get("event") for line in log.read_text().splitlines() if line.startswith("{")]
    # NOTE: the order matters: a thread keeps the arena of its first allocation, and the step thread loads the model
    assert "allocator keeps freed memory" in events and "worker ready" in events
    assert events.index("allocator keeps freed memory") < events.index("worker ready")
