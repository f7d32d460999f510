"""The Python API's arguments (api.py): its keyword arguments checked against the options table, in-memory values
validated as a job file's are, and the errors written for `batchjob run` said in the API's words (`--kernels
torch` -> `kernels='torch'`)."""
from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Mapping
from typing import Any

from batchjob.job.options.config import FIELDS, ConfigError, JobConfig, load_job
from batchjob.job.options.options import DEFAULTS

IN_MEMORY = "<in memory>"  # JobConfig's input and output, which an in-memory run has none of


def job_config(values: dict) -> JobConfig:
    """The job file's validation for in-memory values (ConfigError, a ValueError, names the field)."""
    return load_job(None, {"input": IN_MEMORY, "output": IN_MEMORY, **values})


_KEYWORDS = frozenset(FIELDS) | {"restart"}
_NOT_VALUES = "or|and|to|in|of|with|for|is|at|on|as"
_FLAG = re.compile(rf"--(?P<no>no-)?(?P<name>[a-z][a-z0-9-]*)"
                   rf"(?P<value> (?!(?:{_NOT_VALUES})\b)(?:[a-z0-9][\w.]*|[A-Z]+)\b(?: or [a-z0-9][\w.]*\b)?)?")


def api_message(text: str) -> str:
    """A message written for `batchjob run` in the API's words: each flag of a keyword argument becomes that
    keyword ("use --kernels auto or torch" -> "use kernels='auto' or 'torch'", "--restart" -> "restart=True")."""
    def keyword(m: re.Match) -> str:
        name = m["name"].replace("-", "_")
        if name not in _KEYWORDS:
            return m[0]
        if name == "restart" or isinstance(DEFAULTS[name], bool):
            return f"{name}={not m['no']}{m['value'] or ''}"
        if m["no"] or not m["value"]:
            return m[0] if m["no"] else name
        values = m["value"].strip().split(" or ")
        return f"{name}=" + " or ".join(v if v.isupper() or v.replace(".", "", 1).isdigit() else repr(v) for v in values)

    return _FLAG.sub(keyword, text)


@contextlib.contextmanager
def api_words():
    """Errors raised inside speak of keyword arguments, not of `batchjob run`'s flags (the same error types)."""
    try:
        yield
    except Exception as e:
        if len(e.args) == 1 and isinstance(e.args[0], str) and not isinstance(e, OSError):
            e.args = (api_message(e.args[0]),)
        raise


def check_names(given: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{unknown[0]}: unknown keyword argument to {where}{meant}; known: {', '.join(allowed)}")
