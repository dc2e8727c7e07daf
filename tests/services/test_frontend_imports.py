"""The frontend process loads tokenizer-level code only: no model, runner, attention or kernels (nor Triton), and
neither torch nor transformers (its tokenizer is a snapshot run with `tokenizers`: engine_core/io/tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys


def test_frontend_imports_no_model_code() -> None:
    code = (
        "import sys, services.frontend.server\n"
        "bad = [m for m in sys.modules if m.startswith(('kernels', 'triton', 'engine_core.worker',"
        " 'engine_core.model', 'engine_core.sample', 'engine_core.attention', 'engine_core.llm',"
        " 'torch', 'transformers'))]\n"
        "print(' '.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
