"""One decision for interpreted vs compiled Triton kernels, and which code pulls Triton in at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.triton_mode import triton_interpreted
from tests.kernels.conftest import DEVICE, INTERPRETED

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` in a fresh interpreter (module state such as sys.modules and TRITON_INTERPRET starts clean)."""
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # NOTE: keep an outer PYTHONPATH (the GPU image's packages travel as wheels on it) after this checkout.
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=clean | env, capture_output=True, text=True, timeout=120
    )


def _kernel_objects() -> list[object]:
    import importlib

    modules = [importlib.import_module(f"kernels.triton.{m}") for m in ("decode_attention", "prefill_attention")]
    modules += [importlib.import_module(f"kernels.triton.{m}") for m in ("store_kv", "fused")]
    return [v for m in modules for k, v in vars(m).items() if k.startswith("_") and k.endswith("_kernel")]


def test_device_follows_the_one_decision() -> None:
    assert triton_interpreted() is INTERPRETED
    assert ("cpu" if INTERPRETED else "cuda") == DEVICE


def test_kernels_are_compiled_on_cuda() -> None:
    """On a GPU machine the kernels must be real compiled JIT functions, never the interpreter."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: kernels are interpreted here (see test_kernels_are_interpreted_without_cuda)")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert not INTERPRETED, "TRITON_INTERPRET is on although a CUDA device is visible"
    kernels = _kernel_objects()
    assert len(kernels) == 7
    for kernel in kernels:
        assert isinstance(kernel, JITFunction) and not isinstance(kernel, InterpretedFunction), kernel


def test_kernels_are_interpreted_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: kernels are compiled (see test_kernels_are_compiled_on_cuda)")
    from triton.runtime.interpreter import InterpretedFunction

    assert INTERPRETED
    kernels = _kernel_objects()
    assert len(kernels) == 7 and all(isinstance(k, InterpretedFunction) for k in kernels)


def test_cpu_kernels_and_the_cpu_engine_import_no_triton() -> None:
    """`from kernels import cpu`, the model, the runner and the non-Triton backends leave Triton unimported."""
    code = (
        "import sys\n"
        "from kernels import cpu\n"
        "import engine_core.worker.model_runner, engine_core.model.llama\n"
        "import engine_core.attention.selector, engine_core.attention.torch_backend\n"
        "import engine_core.attention.cpu_backend\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith('kernels.triton.'))\n"
        "assert not bad, bad\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr


def test_switch_refuses_to_run_after_triton_was_imported() -> None:
    """Too late is an error naming the fix, not triton's opaque failure inside the first interpreted kernel."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the switch leaves the interpreter off, so importing triton first is harmless")
    res = _python(
        "import triton\nfrom kernels.triton_mode import configure_triton_interpret\nconfigure_triton_interpret()\n"
    )
    assert res.returncode != 0 and "configure_triton_interpret() ran" in res.stderr
    # Set first, then import: fine, and idempotent.
    ok = _python(
        "from kernels.triton_mode import configure_triton_interpret\n"
        "assert configure_triton_interpret()\nimport kernels.triton\nassert configure_triton_interpret()\n"
    )
    assert ok.returncode == 0, ok.stderr


def test_explicit_setting_is_respected() -> None:
    res = _python(
        "import os\nfrom kernels.triton_mode import configure_triton_interpret\n"
        "assert configure_triton_interpret() is False\nassert os.environ['TRITON_INTERPRET'] == '0'\n",
        TRITON_INTERPRET="0",
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_the_engine_runs_after_a_script_imported_transformers_and_triton() -> None:
    """A new user's script may import transformers (which imports triton) before the engine: the CPU backends never
    run a Triton kernel, so that order must work; only the Triton backend on a CUDA-less machine needs the switch."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the interpreter stays off whatever the import order")
    res = _python(
        "import transformers, triton\n"
        "from engine_core import LLM, SamplingParams\n"
        "llm = LLM(kv_cache_memory=0.1)\n"
        "out = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4))\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
    )
    assert res.returncode == 0, res.stderr
    triton_backend = _python("import triton\nfrom engine_core import LLM\nLLM(attention_backend='triton')\n")
    assert triton_backend.returncode != 0 and "configure_triton_interpret() ran" in triton_backend.stderr
