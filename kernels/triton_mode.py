"""The one place that decides whether Triton kernels are compiled (CUDA) or run by Triton's interpreter (CPU).

`triton.jit` reads `TRITON_INTERPRET` when a kernel is *decorated*, and triton decorates its own library functions
(`tl.sigmoid`, `tl.cdiv`, ...) when it is first imported, by whoever imports it first (transformers does, during a
forward). A compiled library function cannot be called from an interpreted kernel, so the switch must be set before
anything imports triton: `configure_triton_interpret()` is called by every entry point (the engine package, the test
suite, the GPU check) and by `kernels.triton` itself, and it refuses to run too late.

The rule: interpret exactly when torch sees no CUDA device (so the Triton backend's tensors, which live on the
engine's device, are CPU tensors precisely when the kernels are interpreted). An explicit `TRITON_INTERPRET` in the
environment, either way, is respected.

This module imports no triton.
"""

from __future__ import annotations

import os
import sys

import torch

# triton's own reading of the variable (triton.knobs env_bool): these spellings mean "on".
_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpreted() -> bool:
    """Whether Triton kernels decorated from now on run in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def configure_triton_interpret(strict: bool = True) -> bool:
    """Sets `TRITON_INTERPRET=1` when no CUDA device is visible (unless the variable is set); returns whether kernels
    are interpreted. Idempotent.

    When it would switch the interpreter on but triton is already imported, triton's library functions were decorated
    as compiled functions and every interpreted kernel that calls one would fail with triton's opaque "Cannot call
    @triton.jit'd outside of the scope of a kernel". `strict` (the Triton kernels' own import) raises RuntimeError
    then; otherwise (the engine's entry, whose default CPU backends never run a Triton kernel) it leaves the mode as
    it is, so a script may import transformers or triton before the engine.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        if "triton" in sys.modules:
            if not strict:
                return triton_interpreted()
            raise RuntimeError(
                "triton was imported before kernels.triton_mode.configure_triton_interpret() ran on a machine without "
                "CUDA; call it first in the entry point (or set TRITON_INTERPRET=1 in the environment)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
    return triton_interpreted()
