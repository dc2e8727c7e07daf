"""CPUs this process may use: its affinity, capped by a cgroup CPU limit (a pod's `resources.limits.cpu`).

NOTE: why: torch sizes its OpenMP team from the affinity mask, which in a Kubernetes pod is usually the whole node.
A CPU limit is a CFS quota, not an affinity: a 4-CPU pod on a 64-core node would run 64 compute threads on 4 CPUs'
time, throttled every period, each parallel region waiting at its barrier for threads that are not running. So the
engine's default team is no larger than the limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")
_SELF_CGROUP = Path("/proc/self/cgroup")


def _limit(directory: Path, v2: bool) -> float | None:
    """The CPU limit set in one cgroup directory, in CPUs; None where there is none (or nothing readable)."""
    try:
        if v2:
            quota, period = (directory / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        return None if quota_us <= 0 else quota_us / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def cpu_limit(root: Path = _CGROUP, self_cgroup: Path = _SELF_CGROUP) -> float | None:
    """The tightest CPU limit over this process's cgroup and its ancestors (cgroup v2 `cpu.max` or v1's CFS quota),
    in CPUs; None when nothing limits it."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # not "id:controllers:path": skipped, so a start never fails over this file
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        if v2:
            base = root
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
        else:
            continue
        # NOTE: in a container with its own cgroup namespace the path is "/" and `base` is its cgroup; on a host it
        # is the process's cgroup under `base`, and a limit may sit on any ancestor.
        directory = base / path.lstrip("/")
        while True:
            limit = _limit(directory, v2)
            if limit is not None:
                limits.append(limit)
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return min(limits) if limits else None


def usable_cpus() -> int:
    """CPUs this process may run on (a container's cpuset, `taskset`), no more than its CPU limit (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cpu_limit()
    return max(1, min(cpus, math.floor(limit))) if limit is not None else cpus
