"""CPU threads of each `pagoda serve` process: the worker's compute team, and the control processes kept off it.

The scheduler and the frontend do Python bookkeeping, tokenization and streaming; they never need torch's intra-op
parallelism. Left at torch's defaults they would each own an OpenMP team as large as the machine, whose idle threads
spin (GNU OpenMP spins ~300,000 iterations, measured ~6 ms of CPU, after every parallel region) on the cores the
worker computes on. So both run with one intra-op thread and a passive OpenMP wait policy.

The worker keeps a team as large as its cores and OpenMP's default wait policy (GNU OpenMP spins briefly at each
barrier before it sleeps). NOTE: measured on 2 quiet cores (docs/benchmarks.md, "Worker threads and OpenMP waits"),
passive waiting cost the worker a futex wake per parallel region, ~150 per decode step: 64 streams 337 vs 402 total
tok/s and batch 1 37.8 vs 27.7 ms/token; a shorter spin (GOMP_SPINCOUNT=20000) was within the noise of the default.
Spinning only hurts where the worker's cores are oversubscribed (other busy processes on them): set
OMP_WAIT_POLICY=PASSIVE there.
"""

from __future__ import annotations

import os
import sys

from engine_core.host_cpus import usable_cpus

# NOTE: read by libgomp / MKL when torch is first imported, hence set before any service module is imported.
CONTROL_PROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def default_worker_threads(num_workers: int = 1) -> int:
    """Torch threads per worker of `pagoda serve`: the usable CPUs (affinity, capped by a CPU limit) shared by the
    workers, none held back.

    NOTE: measured on 2 cores (docs/benchmarks.md, "Worker threads and OpenMP waits"): holding a core back for the
    scheduler and frontend (the old default, cores - 1) cost 38 % of the throughput at 64 streams (243 vs 390 total
    tok/s), while those two processes use a fraction of one core (CPU seconds per 1,000 tokens in
    benchmarks/side_by_side.py) once they neither spin nor run OpenMP teams of their own.
    """
    return max(1, usable_cpus() // max(1, num_workers))


def limit_control_process_threads() -> None:
    """For the scheduler and frontend processes: one intra-op thread, no spinning (user settings win)."""
    for key, value in CONTROL_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    torch = sys.modules.get("torch")
    if torch is not None:  # already imported (the env came too late for it): cap the team directly
        torch.set_num_threads(1)
