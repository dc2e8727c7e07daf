"""Shared fixtures: the real SmolLM2 weights (converted once, cached), its tokenizer, one float32 engine and one
transformers reference model on them for the whole session, and tiny random Llamas."""

from __future__ import annotations

from kernels.triton_mode import configure_triton_interpret

# NOTE: first, before anything imports triton (the same decision the kernels package makes).
INTERPRETED = configure_triton_interpret()
# Where tests that run the Triton kernels put the engine: compiled kernels need CUDA tensors, interpreted ones CPU.
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"

from pathlib import Path

import pytest
import torch

from engine_core.config import default_cache_dir

CACHE_DIR = default_cache_dir()

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF directory of SmolLM2-135M-Instruct (converted from the packaged GGUF on first use)."""
    # NOTE: imported here, not at the top, so the kernel tests also collect where only torch/triton/pytest exist.
    from engine_core.checkpoint.model_files import resolve_model_dir

    return resolve_model_dir(None, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    """Pagoda's tokenizer of the model (a snapshot of transformers' one, read without transformers)."""
    from engine_core.io.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir, CACHE_DIR)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_dir: str):
    """transformers' own tokenizer of the model: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def offline_llm(smollm2_dir: str):
    """One float32 engine on SmolLM2 for every test that only generates with it (the services' offline reference,
    greedy and beam equality, the float32 side of the bf16/int8 quality tests, the offline API tests).
    NOTE: shared because each load decodes the GGUF file again (seconds per engine); a test that needs its own
    engine settings, an empty prefix cache or a blank scheduler builds its own. Its prefix cache outlives a test:
    cached blocks count as free, and requests with prompt_logprobs bypass it."""
    from engine_core import LLM

    return LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.5)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_dir: str) -> torch.nn.Module:
    """transformers' own float32 model of SmolLM2, the reference: it decodes the GGUF file itself, so it shares none
    of Pagoda's loading code. Read only (forward passes and generate)."""
    from transformers import AutoModelForCausalLM

    from engine_core.checkpoint.model_dir import transformers_kwargs

    return AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, **transformers_kwargs(smollm2_dir)
    ).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF directory of a 2-layer random Llama (vocab 128, GQA 4/2): the engine against transformers, in seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaky logits: argmax is not decided by rounding noise
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_vocab_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and full vocabulary (49152): for what needs real token text
    (grammars) at the speed of a tiny model."""
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-vocab-llama")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2_dir) / name, path / name)
    return path
