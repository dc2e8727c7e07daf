"""The scheduler and frontend processes run one torch thread and never spin; workers get every usable core."""

from __future__ import annotations

import os
import subprocess
import sys

from engine_core.host_cpus import usable_cpus
from services.common.threads import default_worker_threads

PROBE = (
    "import os, sys, torch; "
    "print(torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'], os.environ['OMP_NUM_THREADS'], "
    "'torch' in sys.modules)"
)


def _run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.getcwd()
    return env


def test_control_process_limits_apply_before_torch_loads() -> None:
    code = "from services.common.threads import limit_control_process_threads as f; f(); " + PROBE
    assert _run(code, _clean_env()) == "1 PASSIVE 1 True"


def test_control_process_limits_cap_an_already_imported_torch() -> None:
    code = "import torch; from services.common.threads import limit_control_process_threads as f; f(); " + PROBE
    assert _run(code, _clean_env()).split()[0] == "1"


def test_user_settings_win() -> None:
    env = _clean_env() | {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2"}
    code = "from services.common.threads import limit_control_process_threads as f; f(); " + PROBE
    assert _run(code, env).split()[1:3] == ["ACTIVE", "2"]


def test_worker_threads_default_to_the_usable_cores() -> None:
    cores = usable_cpus()  # NOTE: this machine's affinity, or less under a CPU limit (tests/test_host_cpus.py)
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert default_worker_threads() == cores
    assert default_worker_threads(num_workers=cores * 2) == 1
