"""Integer ranges of the Protobuf fields: a value the messages cannot carry is refused at the edge, by name.

Without this a too-large HTTP value (Python ints are unbounded) fails in the serializer deep inside the request
path, and a derived value (choice i of a seeded request uses seed + i) fails when the step is serialised on the
scheduler's engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_core.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def check_ints(name: str, values: Iterable[int], lo: int = INT32_MIN, hi: int = INT32_MAX) -> None:
    """ValueError starting with `name` when a value is outside [lo, hi]."""
    for v in values:
        if not lo <= v <= hi:
            raise ValueError(f"{name} contains {v}, outside [{lo}, {hi}]")


def check_wire_ranges(params: SamplingParams) -> None:
    """Every integer of the sampling parameters fits its wire type, derived per-choice seeds included."""
    for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None:
            check_ints(name, [value])
    check_ints("stop_token_ids", params.stop_token_ids or [])
    check_ints("logit_bias", list(params.logit_bias or {}))
    check_ints("allowed_token_ids", params.allowed_token_ids or [])
    if params.seed is not None:
        # NOTE: choice i runs with seed + i, which must still fit the int64 of the step message.
        check_ints("seed", [params.seed], INT64_MIN, INT64_MAX - (params.n - 1))
