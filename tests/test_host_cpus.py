"""The engine's default CPU team is no larger than a cgroup CPU limit (engine_core/host_cpus.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.host_cpus import cpu_limit

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_the_tightest_limit_over_the_ancestors(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "cpu.max", "max 100000\n")
    write(root / "kubepods" / "cpu.max", "250000 100000\n")  # the pod: 2.5 CPUs
    write(root / "kubepods" / "c1" / "cpu.max", "max 100000\n")  # the container: no limit of its own
    write(tmp_path / "self", "0::/kubepods/c1\n")
    assert cpu_limit(root, tmp_path / "self") == 2.5
    write(tmp_path / "self", "0::/\n")  # a container with its own cgroup namespace: its cgroup is the root
    assert cpu_limit(root, tmp_path / "self") is None
    write(root / "cpu.max", "50000 100000\n")
    assert cpu_limit(root, tmp_path / "self") == 0.5


def test_cgroup_v1_cfs_quota_in_a_comounted_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    base = root / "cpu,cpuacct"
    write(base / "pod" / "cpu.cfs_quota_us", "150000\n")
    write(base / "pod" / "cpu.cfs_period_us", "100000\n")
    write(base / "pod" / "c" / "cpu.cfs_quota_us", "-1\n")  # unlimited itself: the pod's limit holds
    write(base / "pod" / "c" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "self", "12:memory:/pod/c\n4:cpu,cpuacct:/pod/c\n0::/\n")
    assert cpu_limit(root, tmp_path / "self") == 1.5


def test_nothing_readable_is_no_limit(tmp_path: Path) -> None:
    assert cpu_limit(tmp_path, tmp_path / "missing") is None
    write(tmp_path / "self", "garbage\n")
    assert cpu_limit(tmp_path, tmp_path / "self") is None
    write(tmp_path / "self", "0::/a\n")
    write(tmp_path / "a" / "cpu.max", "garbage\n")
    assert cpu_limit(tmp_path, tmp_path / "self") is None


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(not os.access(V1_CPU / "cgroup.procs", os.W_OK), reason="needs a writable cgroup v1 cpu controller")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to show the cap")
def test_a_model_runner_in_a_one_cpu_cgroup_runs_one_thread(tiny_dir: Path) -> None:
    group = V1_CPU / f"pagoda-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")  # 1 CPU of time, every CPU in the affinity
        code = (
            "import torch; from engine_core.config import EngineConfig; "
            "from engine_core.worker.model_runner import ModelRunner; "
            f"ModelRunner(EngineConfig(dtype='float32'), {str(tiny_dir)!r}); print(torch.get_num_threads())"
        )
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env["PYTHONPATH"] = str(REPO)

        def threads(extra: dict[str, str]) -> str:
            out = subprocess.run(
                [sys.executable, "-c", code],
                cwd=REPO,
                env=env | extra,
                capture_output=True,
                text=True,
                timeout=300,
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
            )
            assert out.returncode == 0, out.stdout + out.stderr
            return out.stdout.split()[-1]

        assert threads({}) == "1"
        assert threads({"OMP_NUM_THREADS": "2"}) == "2"  # NOTE: a size the user chose is kept
    finally:
        group.rmdir()
