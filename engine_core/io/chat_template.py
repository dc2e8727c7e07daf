"""A model's chat template, rendered as transformers renders it (`transformers.utils.chat_template_utils`).

Chat templates come with models and are untrusted code: they run in jinja's immutable sandbox, see only plain data
(str, numbers, lists, dicts) and get the environment transformers gives them: `trim_blocks`/`lstrip_blocks`, the
`loopcontrols` extension, the `{% generation %}` tag (here: renders its body), a `tojson` filter that does not
escape HTML, and `raise_exception`, `strftime_now`, `dict` and a `namespace` without underscore attributes.
tests/test_tokenizer.py renders templates using each of them with both this and transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` in templates, without attribute access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore attributes (a path towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # NOTE: jinja's signature trick: `namespace(self=...)` works
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain_data(value: Any) -> Any:
    """What a template may see: JSON-like values rebuilt from their base types; anything else a placeholder naming
    its type (objects with methods the sandbox does not know to be dangerous never reach it)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (enums, ...) are taken back to their base type, without their methods
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


class ChatTemplate:
    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        env.globals.update(dict=_TemplateDict(), namespace=_TemplateNamespace)
        self.template = env.from_string(source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        special_tokens: Mapping[str, str],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        # NOTE: as transformers: keys whose value is None are dropped (OpenAI clients send `content: null`, which many
        # templates would render as "None"), and the special tokens (bos_token, ...) are template variables.
        chat = [_plain_data({k: v for k, v in m.items() if v is not None}) for m in messages]
        return self.template.render(
            messages=chat,
            tools=_plain_data(list(tools)) if tools else None,  # NOTE: as transformers: JSON tool definitions
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain_data(dict(special_tokens)),
        )
