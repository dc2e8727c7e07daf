"""The one decision whether Triton kernels run compiled or in Triton's interpreter (TRITON_INTERPRET)."""

from __future__ import annotations

import os


def configure_triton_interpret() -> bool:
    """Turns the interpreter on where no CUDA device exists; an explicit TRITON_INTERPRET (either way) wins.

    Returns whether kernels will be interpreted. NOTE: `triton.jit` reads TRITON_INTERPRET when a kernel is
    *decorated* (its module imported), and triton decorates its own library functions when it is first imported
    (transformers may import it), so callers run this before anything imports triton. Without a CUDA device the
    interpreter is the only way the kernels run at all (on CPU tensors).
    """
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
