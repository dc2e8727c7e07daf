"""Where one model-runner step spent its time, as plain readings of time.perf_counter().

The worker service turns these into the children of its `Execute` span (input preparation, forward, sampling);
engine_core itself knows nothing of tracing. On a GPU the forward pass is asynchronous: its phase ends when the
kernels are queued, and the wait for them shows up in sampling (whose token copy to the host synchronizes).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimings:
    start: float = 0.0  # execute() entered (deltas applied from here)
    forward_start: float = 0.0  # inputs prepared, forward pass begins
    sample_start: float = 0.0  # forward pass returned: logits and sampling begin
    # forward_start and sample_start stay 0 for a step that only dropped sequences (no forward pass)
    end: float = 0.0
    collective_s: float = 0.0  # tensor parallelism: seconds inside collectives (waiting for peers included)
