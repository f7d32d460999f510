"""What every input source shares: the row it yields (`InputRow`), the `Source` interface and
`SourceError`, and the helpers for folders of data files and for records narrowed to some columns."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pyarrow as pa

from batchjob.io.ranges import RowRanges

log = logging.getLogger(__package__)  # one logger for all the sources: batchjob.io.sources


@dataclass(slots=True)
class InputRow:
    row_index: int  # 0-based position in the whole input
    record: dict | None  # column -> python value; None when the row could not be parsed
    error: str | None = None  # per-row problem, e.g. "data.jsonl line 17: invalid JSON: ..."
    where: str | None = None  # the row's place, where a source names it ("requests.jsonl line 17"): for the
    # errors found later (its prompt, its inputs), said as the source's own are


class SourceError(Exception):
    """A job-level input problem; the message names the file and what to do."""


class Source:
    """An input's rows. What a reader of it may ask besides its rows is a method here, answered by each format (the
    job never asks which class it holds)."""
    format_name: ClassVar[str] = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: list[Path] = [path]  # the data files read, in reading order (the job fingerprint hashes them)
        self.columns: list[str] = []
        self.num_rows: int | None = None
        self.num_bytes: int | None = None  # JSONL: the bytes its row offsets count up to (progress by bytes read)

    @property
    def whole(self) -> Source:
        """The source whose files are read: itself; a shard's, the whole input it slices."""
        return self

    @property
    def seeks(self) -> bool:
        """Whether `rows(start_offset=...)` and `position()` resume at a byte offset (JSONL) rather than by skipping
        committed rows' units."""
        return False

    def position(self) -> tuple[int, int]:
        """A seeking source's (next row_index, byte offset) after the last row it yielded."""
        raise NotImplementedError(f"{self.format_name} input does not resume at byte offsets")

    def shard(self) -> dict | None:
        """What a shard's manifest records of its slice (sharding/shards.py); None for a whole input."""
        return None

    def check_task(self, task: str) -> None:
        """Raises SourceError where the input's own requests ask for another task than the job's (OpenAI Batch)."""

    def other_models(self, served: set[str]) -> Counter[str]:
        """Model names the input's own requests give that the job does not serve: name -> rows (OpenAI Batch)."""
        return Counter()

    def carries_tools(self, column: str) -> bool:
        """Whether its rows carry tools: the `column` among its columns, or (OpenAI Batch) bodies with tools."""
        return column in self.columns

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        """Rows in input order, leaving out `skip`. `columns` narrows each record (a read hint)."""
        raise NotImplementedError

    def unit_starts(self) -> list[int]:
        """Row indices where a unit a reader can skip whole (Parquet row group or file, datasets
        shard) begins; shards cut here so that none reads another's data."""
        return [0]

    def describe(self) -> str:
        count = f"{self.num_rows} rows" if self.num_rows is not None else "row count unknown"
        return f"{self.path} ({self.format_name}, {count}, columns: {', '.join(self.columns)})"


def narrow(record: dict, columns: list[str] | None) -> dict:
    """The record's `columns` (those it has), or the whole record when `columns` is None."""
    return record if columns is None else {c: record[c] for c in columns if c in record}


def is_hidden(name: str) -> bool:
    # pyarrow's and Spark's rule: _SUCCESS, _metadata, .crc files and the like are not data
    return name.startswith((".", "_"))


def folder_files(folder: Path, is_member: Callable[[Path], bool], what: str, *, recursive: bool = False) -> list[Path]:
    """The files of `folder` that are members, in path order. Everything else (hidden names aside)
    is named in one warning, so a file left out by its name does not go unnoticed."""
    members, skipped = [], []
    if recursive:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not is_hidden(d))
            for name in files:
                if not is_hidden(name):
                    file = Path(root) / name
                    (members if is_member(file) else skipped).append(file)
    else:
        for entry in folder.iterdir():
            if is_hidden(entry.name):
                continue
            if entry.is_file() and is_member(entry):
                members.append(entry)
            else:
                skipped.append(entry)
    if skipped:
        names = sorted(p.relative_to(folder).as_posix() + ("/" if p.is_dir() else "") for p in skipped)
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        log.warning("%s: %d %s skipped, not %s: %s", folder, len(names), "entry" if len(names) == 1 else "entries", what, shown)
    return sorted(members, key=lambda p: p.relative_to(folder).as_posix())


def record_batch_rows(batch: pa.RecordBatch, first_row: int, skip: RowRanges | None,
                      batch_rows: int) -> Iterator[InputRow]:
    """The rows of an Arrow record batch whose first row is `first_row`, leaving out `skip`."""
    # Convert at most batch_rows rows to Python at a time; slices are zero-copy.
    for offset in range(0, batch.num_rows, batch_rows):
        start = first_row + offset
        piece = batch.slice(offset, batch_rows)
        if skip is not None and skip.covers(start, start + piece.num_rows):
            continue
        for i, record in enumerate(piece.to_pylist()):
            if skip is None or start + i not in skip:
                yield InputRow(start + i, record)
