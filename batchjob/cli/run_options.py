"""`batchjob run`'s flags, made from the options table (job/options.py): one per job-file field, each overriding
the job file's value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from batchjob.job.options import OPTIONS, TYPES, Option, mode_of, scalar_types


@dataclass(slots=True, frozen=True)
class RunOption:
    flag: str  # "--max-tokens", or "--chat/--no-chat" for a boolean
    field: str  # the JobConfig field (and job-file key) it sets
    type: Any  # a click type, or None for a boolean flag pair
    help: str


def _click_type(name: str, o: Option):
    """The flag's click type: a mode's choices, the scalar type (in its bounds); lists, schemas and
    the error limit are text the job's parser reads (job/config.py)."""
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


# Every option of the table (job/options.py) but the job-file-only ones has a flag; a flag overrides the job file.
# docs/reference/run-options.md is made from these (cli/reference.py).
RUN_OPTIONS = [RunOption(_flag(name, o), name, _click_type(name, o), o.help) for name, o in OPTIONS.items() if o.flag != ""]


def run_options(fn):
    """The JOB argument and a click option per RUN_OPTIONS entry; an option not given is None, so the job
    file's value stands."""
    for o in reversed(RUN_OPTIONS):
        if o.type is None:
            fn = click.option(o.flag, o.field, default=None, help=o.help)(fn)
        else:
            fn = click.option(o.flag, o.field, type=o.type, default=None, help=o.help)(fn)
    return click.argument("job", required=False, type=click.Path(dir_okay=False))(fn)
