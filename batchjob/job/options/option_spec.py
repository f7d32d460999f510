"""How one job option is declared (job/options/options.py holds the table): where its key may stand in the job file, the
Python API's keyword group that takes it, how it enters the job's fingerprint, the bounds its flag enforces, and
`opt(...)`, which makes a JobConfig field carrying its Option."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any


class Table(StrEnum):
    """Where a key may stand in the job file besides the top level (`[job]` holds any key, as the top level does)."""
    JOB = "job"
    SAMPLING = "sampling"
    STRUCTURED = "structured_outputs"
    EMBED = "embed"
    ENGINE = "engine"
    OUTPUT = "output"
    LORA = "lora"


class Api(StrEnum):
    """The Python API's keyword groups (api.py): per call (sampling, chat, embed, score) or per loaded engine."""
    SAMPLING = "sampling"
    CHAT = "chat"
    EMBED = "embed"
    SCORE = "score"
    ENGINE = "engine"


class Identity(Enum):
    """How an option enters the job's fingerprint (job/options/fingerprint.py): always, only when it differs from its
    default (an option added later: an older job's fingerprint stays the same), or not at all (how the job runs,
    not what it computes; the task, structured outputs, dtype and quantization are entered by fingerprint.py)."""
    ALWAYS = "always"
    WHEN_SET = "when set"
    NO = "no"


@dataclass(frozen=True, slots=True)
class Bounds:
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is outside


@dataclass(frozen=True, slots=True)
class Option:
    help: str
    table: Table = Table.JOB
    api: frozenset[Api] = frozenset()
    identity: Identity = Identity.NO
    flag: str | None = None  # None: --the-name (--name/--no-name for a boolean); "": no flag (a job-file key only)
    bounds: Bounds | None = None  # the flag refuses values outside these (the job's checks say why in its words)
    # a list of free texts (`stop`): one value given as text is one item, or a JSON list of them; never split at commas
    texts: bool = False


def opt(default: Any, help: str, *, table: Table = Table.JOB, api: Api | set[Api] | None = None,
        fingerprint: Identity = Identity.NO, flag: str | None = None, bounds: Bounds | None = None,
        texts: bool = False) -> Any:
    """A JobConfig field with its Option in the field's metadata."""
    groups = frozenset() if api is None else frozenset({api} if isinstance(api, Api) else api)
    meta = {"option": Option(help, table, groups, fingerprint, flag, bounds, texts)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
