"""Chat templates: render a model's Jinja chat template the way HF transformers does, in a sandbox.

Templates come with downloaded models, so they are untrusted code: they run in Jinja's immutable
sandbox, which refuses underscore attributes and mutating builtins.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    pass


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    **variables,
) -> str:
    """Render `messages` with `template`; `variables` (bos_token, eos_token, tools, ...) are template globals."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError(f"messages must be a list of dicts, got {messages!r:.200}")
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
    except TemplateError as e:  # includes raise_exception() from the template itself
        raise ChatTemplateError(str(e)) from e
    except Exception as e:  # a template can hit any Python error, e.g. a KeyError on a message field
        raise ChatTemplateError(f"{type(e).__name__}: {e}") from e


def compile_template(template: str) -> None:
    """Raises ChatTemplateError when `template` is not valid Jinja (checked once per job, not per row)."""
    _compile(template)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from e


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    # Same settings, filters and globals as transformers' `_compile_jinja_template`, so output matches.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` without handing the template the `dict` type itself
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Jinja's Namespace accepts any attribute name; dunders would reach CPython internals
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()
