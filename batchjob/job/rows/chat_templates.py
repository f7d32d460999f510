"""A chat template given instead of the model's: read from its file (a job's `chat_template`) or, in the Python
API, also given as the Jinja text itself; and checked once, before any row, by compiling it in the sandbox
(models/chat.py). Torch-free."""
from __future__ import annotations

from pathlib import Path

from batchjob.errors import ConfigError


def read_template(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"chat_template: cannot read {path}: {e.strerror or e}") from None


def template_text(value: str | Path | None) -> str | None:
    """The API's chat_template: a template file, as a job's, or (as vLLM also takes) the Jinja text itself."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise ConfigError(f"chat_template: expected a file path or the template text, got {value!r}")
    if isinstance(value, str) and "{" in value:  # Jinja needs {{ or {%; a path rarely has a brace
        return value
    return read_template(value)


def check_chat_template(template: str | None, name: str | None = None) -> None:
    """Compiles `template` (None: the model has none; rows say so one by one); a ConfigError names it (`name`:
    the file or the model, where the message should say which)."""
    from batchjob.models.chat import ChatTemplateError, compile_template

    if template is None:
        return
    try:
        compile_template(template)
    except ChatTemplateError as e:
        raise ConfigError(f"chat_template: {name}: {e}" if name else f"chat_template: {e}") from None
