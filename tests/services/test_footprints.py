"""The scheduler and the frontend never load torch or transformers (2-3 s of CPU and 200-250 MB each at every
start, taken from the worker's cores while it loads the model on a machine that runs all three): the scheduler is
bookkeeping, the frontend tokenizes with a snapshot of transformers' tokenizer (engine_core/io/tokenizer.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.client import GenerationClient, text_request
from services.launcher import LocalCluster

ROOT = Path(__file__).resolve().parents[2]


def test_the_scheduler_module_imports_neither_torch_nor_transformers() -> None:
    # NOTE: the frontend module's imports: test_frontend_imports.py
    code = "import sys, services.scheduler.server; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_running_scheduler_has_no_torch_mapped_after_logprobs(
    cluster: LocalCluster, client: GenerationClient
) -> None:
    # logprobs travel worker -> scheduler as matrices; the scheduler decodes them without torch
    result = client.generate(text_request("Hello", max_tokens=3, logprobs=2, prompt_logprobs=1))
    assert result.choices[0].token_ids
    maps = Path(f"/proc/{cluster.service('scheduler').process.pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "libtorch" in Path(f"/proc/{cluster.service('worker0').process.pid}/maps").read_text()  # the check sees it


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/<pid>/maps")
def test_the_running_frontend_has_no_torch_mapped_after_chat_and_text(
    cluster: LocalCluster, client: GenerationClient
) -> None:
    # a chat template rendered, text encoded, output decoded with logprob texts: all without transformers
    chat = client.generate(text_request("Hi", max_tokens=3, chat=True, logprobs=1))
    text = client.generate(text_request("Hello", max_tokens=3))
    assert chat.choices[0].token_ids and text.choices[0].token_ids
    maps = Path(f"/proc/{cluster.service('frontend').process.pid}/maps").read_text()
    assert "libtorch" not in maps
