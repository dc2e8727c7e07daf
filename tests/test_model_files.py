"""Config loading: the fast path (a plain Llama's config.json in the engine's own `LlamaConfigFile`) reads what
AutoConfig would, and keeps transformers off the start-up path (the tokenizer: tests/test_tokenizer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig, MistralConfig

from engine_core.checkpoint.model_config import LlamaConfigFile
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
    assert isinstance(fast, LlamaConfigFile)  # the fast path was taken
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


@pytest.mark.parametrize(
    ("raw", "rope_theta"),
    [
        pytest.param(_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), 500000.0, id="v5"),
        pytest.param(_llama(rope_parameters=None, rope_theta=250000.0), 250000.0, id="v4-rope-theta"),
        pytest.param(_llama(rope_parameters=None), 10000.0, id="no-theta"),
    ],
)
def test_plain_llama_configs_read_their_rope_theta_as_autoconfig_does(
    tmp_path: Path, raw: dict[str, object], rope_theta: float
) -> None:
    fast, full = load_config(_write(tmp_path, raw)), AutoConfig.from_pretrained(str(tmp_path))
    assert isinstance(fast, LlamaConfigFile)
    assert fast.rope_parameters == full.rope_parameters == {"rope_type": "default", "rope_theta": rope_theta}
    for key in ENGINE_READS:
        assert getattr(fast, key) == getattr(full, key), key


@pytest.mark.parametrize("key", ["num_hidden_layers", "rms_norm_eps", "head_dim"])
def test_a_wrongly_typed_llama_field_is_refused_naming_it(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match=f"config.json: {key} = 'many'"):
        load_config(_write(tmp_path, _llama(**{key: "many"})))


def test_loading_the_default_model_leaves_transformers_unimported(smollm2_dir: str) -> None:
    """What `pagoda serve`'s worker and frontend and the offline `LLM` load at start-up imports no transformers (its
    config classes alone are ~17-20 MB of RSS; its model configs pull in torch._dynamo)."""
    code = (
        "import sys\n"
        "from engine_core.model.loader import load_config\n"
        "from engine_core.io.tokenizer import load_tokenizer\n"
        f"load_config({smollm2_dir!r}); load_tokenizer({smollm2_dir!r}, {CACHE_DIR!r})\n"
        "heavy = [m for m in ('transformers', 'torch._dynamo') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
