"""Pagoda's tokenizer (a snapshot of transformers' one, read with `tokenizers` alone) against transformers itself:
encode, decode, tokens and chat templates give the same results, the snapshot is reused and rebuilt when the
model's tokenizer files change, and loading one imports neither transformers nor torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jinja2
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine_core.io.tokenizer import INFO_FILE, Tokenizer, hf_tokenizer, load_tokenizer, snapshot_dir
from tests.conftest import CACHE_DIR

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from([*SPECIALS, " ", "\n", "  x", "é"])), max_size=8).map(
    "".join
)
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語 😀 <|im_end|>"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": None},
        {"role": "user", "content": "c\n\n  d "},
    ],
]
# Every part of the environment transformers gives a template: loop controls, namespace, dict(), tojson with its
# arguments (non-ASCII kept), raise_exception, strftime_now, the generation tag, special tokens as variables.
TEMPLATE = """{%- set ns = namespace(n=0) -%}
{{ bos_token }}
{%- for m in messages -%}
{%- if m.role == 'tool' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{%- if m.content is defined and m.content == 'forbidden' %}{{ raise_exception('no: ' + m.role) }}{% endif -%}
<{{ m.role }}>{% if m.content is defined %}{{ m.content | tojson }}{% endif %}
{{- dict(b=m.role, a=1) | tojson(sort_keys=True) }}
{%- if m.extra is defined %}[{{ m.extra | tojson(indent=1) }}]{% endif %}
{% generation %}#{{ ns.n }}{% endgeneration %}
{% if loop.index >= 4 %}{% break %}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<assistant {{ strftime_now('%Y') }}>{{ eos_token }}{% endif %}"""
TEMPLATE_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": 'héllo "quoted" <b>'}],
    [
        {"role": "system", "content": "s"},
        {"role": "tool", "content": "skipped"},
        {"role": "user", "content": None, "extra": {"k": [1, 2.5, None, True], "é": "ü"}},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "after the break"},
    ],
]


def _hf_ids(hf: Any, chat: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    ids = hf.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@settings(max_examples=300, deadline=None)
@given(text=texts, add_special_tokens=st.booleans())
def test_encode_equals_transformers(
    smollm2_tokenizer: Tokenizer, smollm2_hf_tokenizer: Any, text: str, add_special_tokens: bool
) -> None:
    expected = smollm2_hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
    assert smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=16), skip=st.booleans())
def test_decode_and_tokens_equal_transformers(
    smollm2_tokenizer: Tokenizer, smollm2_hf_tokenizer: Any, ids: list[int], skip: bool
) -> None:
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=skip) == smollm2_hf_tokenizer.decode(
        ids, skip_special_tokens=skip
    )
    assert smollm2_tokenizer.convert_ids_to_tokens(ids) == smollm2_hf_tokenizer.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("tokenizer_class", [None, "GPT2Tokenizer"])
def test_the_base_config_chooses_transformers_class(
    smollm2_dir: str, tmp_path: Path, tokenizer_class: str | None
) -> None:
    """`hf_tokenizer` passes config.json in transformers' base class (no model-config import): AutoTokenizer
    picks the class it picks with the model's own config class."""
    extra = {"tokenizer_class": tokenizer_class} if tokenizer_class else {}
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok", **extra)
    assert type(hf_tokenizer(str(d))) is type(AutoTokenizer.from_pretrained(d))


def test_special_ids_equal_transformers(smollm2_tokenizer: Tokenizer, smollm2_hf_tokenizer: Any) -> None:
    assert smollm2_tokenizer.eos_token_id == smollm2_hf_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.info.special_tokens == smollm2_hf_tokenizer.special_tokens_map


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_models_chat_template_equals_transformers(
    smollm2_tokenizer: Tokenizer, smollm2_hf_tokenizer: Any, chat: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = smollm2_hf_tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert smollm2_tokenizer.render_chat(chat, add_generation_prompt) == text
    # NOTE: transformers reads special-token text in messages as control tokens: the trusted reading
    # (tests/test_chat_content.py tests the default, which reads it as text)
    assert smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt, content_special_tokens=True) == _hf_ids(
        smollm2_hf_tokenizer, chat, add_generation_prompt
    )


def _copy_tokenizer(smollm2_dir: str, target: Path, **config: Any) -> Path:
    """SmolLM2's tokenizer files in a directory of their own, with tokenizer_config.json entries changed."""
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(smollm2_dir) / name, target / name)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return target


def test_template_environment_equals_transformers(smollm2_dir: str, tmp_path: Path) -> None:
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text(TEMPLATE)
    ours, hf = load_tokenizer(str(d), str(tmp_path / "cache")), AutoTokenizer.from_pretrained(d)
    for chat in TEMPLATE_CHATS:
        for gen in (True, False):
            expected = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert ours.render_chat(chat, gen) == expected
            assert ours.apply_chat_template(chat, gen) == _hf_ids(hf, chat, gen)
    refused = [{"role": "user", "content": "forbidden"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="no: user"):
        hf.apply_chat_template(refused, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no: user"):
        ours.render_chat(refused)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",  # the usual way out of a sandbox
        "{% set ns = namespace(_x=1) %}",
        "{% set _ = messages.append(1) %}",  # templates cannot change what they are given
    ],
)
def test_templates_run_in_the_sandbox(smollm2_dir: str, tmp_path: Path, template: str) -> None:
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok")
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(jinja2.exceptions.SecurityError):
        load_tokenizer(str(d), str(tmp_path / "cache")).render_chat([{"role": "user", "content": "x"}])


def test_a_class_transformers_rebuilds_is_snapshotted_as_built(smollm2_dir: str, tmp_path: Path) -> None:
    """For a model-specific class (here GPT2's, with a prefix space), transformers rebuilds the pipeline from vocab and
    merges instead of taking tokenizer.json as it is: the snapshot holds what it built, not the file."""
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok", tokenizer_class="GPT2Tokenizer", add_prefix_space=True)
    ours, hf = load_tokenizer(str(d), str(tmp_path / "cache")), AutoTokenizer.from_pretrained(d)
    for text in ["Hello world", " leading space", "x", "<|im_start|>user\nHi<|im_end|>", "日本語 😀"]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    as_in_the_file = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    assert as_in_the_file.encode("x").ids != hf.encode("x")  # the rebuilt pipeline is the one tested


def test_truncation_and_padding_in_the_file_apply_to_no_call(smollm2_dir: str, tmp_path: Path) -> None:
    """A tokenizer.json saved with training settings (truncate to 4, pad to 12) encodes whole prompts, unpadded, in
    transformers; so here."""
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok")
    backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.enable_padding(length=12, pad_id=2, pad_token="<|im_end|>")
    backend.save(str(d / "tokenizer.json"))
    ours, hf = load_tokenizer(str(d), str(tmp_path / "cache")), AutoTokenizer.from_pretrained(d)
    text = "one two three four five six"
    assert len(backend.encode(text).ids) == 12  # what the file alone would do
    assert ours.encode(text) == hf.encode(text)
    assert len(ours.encode(text)) == 6


def test_the_snapshot_is_reused_and_rebuilt_when_the_files_change(smollm2_dir: str, tmp_path: Path) -> None:
    d, cache = _copy_tokenizer(smollm2_dir, tmp_path / "tok"), str(tmp_path / "cache")
    first = snapshot_dir(str(d), cache)
    assert load_tokenizer(str(d), cache).has_chat_template and (first / INFO_FILE).is_file()
    assert snapshot_dir(str(d), cache) == first
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    second = snapshot_dir(str(d), cache)
    assert second != first
    assert load_tokenizer(str(d), cache).render_chat([{"role": "user", "content": "x"}]) == "[x]"
    assert Tokenizer.load(first).render_chat([{"role": "user", "content": "x"}]).startswith("<|im_start|>system")


def test_a_cache_that_cannot_be_written_still_gives_the_tokenizer(smollm2_dir: str, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")  # NOTE: runs as root too, where a read-only mode would not stop the write
    tok = load_tokenizer(smollm2_dir, str(not_a_dir))
    assert tok.encode("Hello world") == [19556, 905]


def test_a_model_without_a_chat_template_says_so(smollm2_dir: str, tmp_path: Path) -> None:
    d = _copy_tokenizer(smollm2_dir, tmp_path / "tok")
    (d / "chat_template.jinja").unlink()
    tok = load_tokenizer(str(d), str(tmp_path / "cache"))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_several_threads_encode_at_once(smollm2_tokenizer: Tokenizer) -> None:
    """The frontend may tokenize on several threads (`--tokenizer-threads`): nothing changes the Rust tokenizer per
    call (transformers' wrapper did, and raised "Already borrowed" from several threads)."""
    text = "héllo wörld <|im_start|>user Hi 日本語 " * 100
    chat = [{"role": "user", "content": text}]
    expected = (smollm2_tokenizer.encode(text), smollm2_tokenizer.apply_chat_template(chat))

    def work(_: int) -> bool:
        return all(
            (smollm2_tokenizer.encode(text), smollm2_tokenizer.apply_chat_template(chat)) == expected for _ in range(50)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


def test_loading_a_snapshot_imports_neither_transformers_nor_torch(smollm2_dir: str) -> None:
    load_tokenizer(smollm2_dir, CACHE_DIR)  # the snapshot exists from here on
    code = (
        "import sys\n"
        "from engine_core.io.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({smollm2_dir!r}, {CACHE_DIR!r})\n"
        "assert tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}])\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
