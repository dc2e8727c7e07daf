"""Config loading: the fast path (config.json in transformers' base class) reads what AutoConfig would, and keeps
transformers' heavy model-config imports off the start-up path (the tokenizer: tests/test_tokenizer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig, MistralConfig

from engine_core.model.loader import load_config
from tests.conftest import CACHE_DIR

ROOT = Path(__file__).resolve().parents[1]
# Every config attribute the engine reads (model_runner, model/llama.py, model.loader.architecture).
ENGINE_READS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "rope_parameters",
)


def test_smollm2_config_fast_path_reads_what_autoconfig_reads(smollm2_dir: str) -> None:
    fast, full = load_config(smollm2_dir), AutoConfig.from_pretrained(smollm2_dir)
    assert not isinstance(fast, LlamaConfig)  # the fast path was taken
    for key in ENGINE_READS:
        assert getattr(fast, key) == getattr(full, key), key
    assert getattr(fast, "sliding_window", None) == getattr(full, "sliding_window", None)


def _write(path: Path, config: dict[str, object]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _llama(**overrides: object) -> dict[str, object]:
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    ).to_dict()
    return {k: v for k, v in (config | overrides).items() if v is not None}


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda c: c.pop("num_key_value_heads"), id="kv-heads-missing"),
        pytest.param(lambda c: c.pop("tie_word_embeddings"), id="tie-missing"),  # the base class would say True
        pytest.param(
            lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
            id="rope-scaled",
        ),
    ],
)
def test_incomplete_or_scaled_llama_configs_go_through_autoconfig(tmp_path: Path, edit: object) -> None:
    raw = _llama()
    edit(raw)  # type: ignore[operator]
    config = load_config(_write(tmp_path, raw))
    assert isinstance(config, LlamaConfig)
    assert config.num_key_value_heads == 4 and config.tie_word_embeddings is False


def test_other_model_types_go_through_autoconfig(tmp_path: Path) -> None:
    raw = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2).to_dict()
    raw.pop("sliding_window")  # Mistral's class default (4096) must apply
    config = load_config(_write(tmp_path, raw))
    assert isinstance(config, MistralConfig) and config.sliding_window == 4096


def test_loading_the_default_model_leaves_transformers_model_configs_unimported(smollm2_dir: str) -> None:
    """What `pagoda serve`'s worker and frontend load at start-up imports none of the model-config chain."""
    code = (
        "import sys\n"
        "from engine_core.model.loader import load_config\n"
        "from engine_core.io.tokenizer import load_tokenizer\n"
        f"load_config({smollm2_dir!r}); load_tokenizer({smollm2_dir!r}, {CACHE_DIR!r})\n"
        "heavy = [m for m in ('transformers.integrations.hub_kernels', 'torch._dynamo') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
