"""`batchjob run`'s flags, made from the options table (job/options/options.py): one per job-file field, each overriding
the job file's value. A flag that names a list (`--lora`, `--stop`, `--keep-columns`, ...) may be repeated: all its
values together are the list (as vLLM's repeated `--lora-modules` entries), which replaces the job file's."""
from __future__ import annotations

import functools
import typing
from dataclasses import dataclass
from typing import Any

import click

from batchjob.job.options.options import OPTIONS, TYPES, Option, mode_of, scalar_types


@dataclass(slots=True, frozen=True)
class RunOption:
    flag: str  # "--max-tokens", or "--chat/--no-chat" for a boolean
    field: str  # the JobConfig field (and job-file key) it sets
    type: Any  # a click type, or None for a boolean flag pair
    help: str
    repeatable: bool = False  # names a list: each use adds to it (click hands the values over as a tuple)


def _click_type(name: str, o: Option):
    """The flag's click type: a mode's choices, the scalar type (in its bounds); lists, schemas and
    the error limit are text the job's parser reads (job/options/config.py)."""
    mode = mode_of(name)
    if mode is not None:
        return click.Choice([m.value for m in mode])
    args = [t for t in scalar_types(name) if t is not type(None)]
    if args == [bool]:
        return None
    base = args[0] if len(args) == 1 and args[0] in (int, float, str) else str
    b = o.bounds
    if b is None:
        return base
    if base is int:
        return click.IntRange(b.low, b.high, min_open=b.low_open)
    return click.FloatRange(b.low, b.high, min_open=b.low_open)


def _flag(name: str, o: Option) -> str:
    if o.flag is not None:
        return o.flag
    dashed = name.replace("_", "-")
    return f"--{dashed}/--no-{dashed}" if TYPES[name] is bool else f"--{dashed}"


def _names_a_list(name: str) -> bool:
    """A list option, or the adapters (NAME=PATH pairs): its flag may be repeated (job/options/config.py joins the values)."""
    return name == "adapters" or any(typing.get_origin(t) is list for t in scalar_types(name))


# Every option of the table (job/options/options.py) but the job-file-only ones has a flag; a flag overrides the job file.
# docs/reference/run-options.md is made from these (cli/reference.py).
RUN_OPTIONS = [RunOption(_flag(name, o), name, _click_type(name, o), o.help, _names_a_list(name))
               for name, o in OPTIONS.items() if o.flag != ""]
REPEATED = " (repeatable: all the values given form the list)"


def run_options(fn):
    """The JOB argument and a click option per RUN_OPTIONS entry; an option not given is None, so the job
    file's value stands. A repeatable flag given once or more is the tuple of its values."""

    @functools.wraps(fn)
    def given(*args, **options):
        return fn(*args, **{k: None if v == () else v for k, v in options.items()})  # a repeatable flag not given

    for o in reversed(RUN_OPTIONS):
        if o.type is None:
            given = click.option(o.flag, o.field, default=None, help=o.help)(given)
        elif o.repeatable:
            given = click.option(o.flag, o.field, type=o.type, multiple=True, help=o.help + REPEATED)(given)
        else:
            given = click.option(o.flag, o.field, type=o.type, default=None, help=o.help)(given)
    return click.argument("job", required=False, type=click.Path(dir_okay=False))(given)
