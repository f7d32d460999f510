"""ArrowSink: writes result rows into an output folder as Arrow IPC part files plus manifest.json.

Commit protocol: a part is written under a temp name, fsynced and renamed, then the manifest that
lists it replaces the old one. Only listed parts count, so a crash anywhere loses at most the rows
still buffered, and reopening the folder sweeps away what the crash left behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from batchjob.io.manifest import Manifest, ManifestError, PartEntry, fsync_dir, utc_now
from batchjob.io.ranges import RowRanges

log = logging.getLogger(__name__)

RESULT_SCHEMA = pa.schema([
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("error", pa.string()),
])
FINISH_REASONS = ("stop", "length", "error")
PART_NAME = re.compile(r"part-(\d{5,})\.arrow")
TEMP_NAME = re.compile(r"\.(part-\d{5,}\.arrow|manifest\.json)\.tmp")


class SinkError(Exception):
    """The output folder cannot be used: not creatable, corrupt manifest, another job's results."""


class FingerprintMismatch(SinkError):
    """The output folder holds results of a different job."""


class ArrowSink:
    def __init__(self, out_dir: str | Path, *, fingerprint: dict, keep_columns: Iterable[str] = (),
                 part_rows: int = 1000, part_seconds: float = 30.0, total_rows: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.keep_columns = list(keep_columns)
        clash = [c for c in self.keep_columns if c in RESULT_SCHEMA.names]
        if clash:
            raise SinkError(f"keep_columns {clash} collide with result columns {RESULT_SCHEMA.names}; "
                            "rename those input columns or do not keep them")
        self.part_rows = part_rows
        self.part_seconds = part_seconds
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            manifest = Manifest.load(self.out_dir)
        except ManifestError as e:
            raise SinkError(str(e)) from e
        except OSError as e:
            raise SinkError(f"cannot use output folder {self.out_dir}: {e}") from e

        fingerprint = json.loads(json.dumps(fingerprint))  # compare as it will read back
        fresh = manifest is None
        if manifest is None:
            manifest = Manifest(fingerprint=fingerprint, total_rows=total_rows)
        else:
            _check_same_job(self.out_dir, manifest, fingerprint, total_rows)
            manifest.total_rows = manifest.total_rows if total_rows is None else total_rows
        self.manifest = manifest
        self.repaired = self._recover()  # names of listed parts that were missing or damaged

        self.done: RowRanges = manifest.done_rows()  # committed rows only
        self._pending = RowRanges()
        self._buffer: list[dict] = []
        self._first_buffered_at: float | None = None
        self._extra_dirty = False
        self._closed = False
        self._types = self._kept_types()
        if fresh or self.repaired:
            manifest.commit(self.out_dir)  # marks the folder as this job's before any part exists

    # writing

    def write(self, row: dict) -> None:
        """Buffer one result row (result fields plus the kept input columns, by name)."""
        if self._closed:
            raise ValueError("write() after close()")
        index = row.get("row_index")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"result row needs a non-negative int row_index, got {index!r}")
        if index in self.done or index in self._pending:
            raise ValueError(f"row {index} was already written to {self.out_dir}")
        if row.get("finish_reason") not in FINISH_REASONS:
            raise ValueError(f"row {index}: finish_reason {row.get('finish_reason')!r} is not one of {FINISH_REASONS}")
        self._buffer.append({name: row.get(name) for name in (*RESULT_SCHEMA.names, *self.keep_columns)})
        self._pending.add_row(index)
        if self._first_buffered_at is None:
            self._first_buffered_at = time.monotonic()
        if len(self._buffer) >= self.part_rows:
            self.commit()
        else:
            self.commit_if_due()

    def commit_if_due(self) -> None:
        """Commit when part_seconds have passed since the oldest buffered row; call while idle."""
        if self._first_buffered_at is not None and time.monotonic() - self._first_buffered_at >= self.part_seconds:
            self.commit()

    def set_extra(self, key: str, value) -> None:
        """Stored in the manifest at the next commit (e.g. a JSONL resume offset, stats)."""
        self.manifest.extra[key] = value
        self._extra_dirty = True

    @property
    def extra(self) -> dict:
        return self.manifest.extra

    def commit(self) -> None:
        if not self._buffer and not self._extra_dirty:
            return
        listed = self.manifest.parts
        if self._buffer:
            self.manifest.parts = [*listed, self._write_part()]
        try:
            self.manifest.commit(self.out_dir)
        except BaseException:
            self.manifest.parts = listed  # the part file stays an orphan until the next resume
            raise
        self.done = self.done.union(self._pending)
        self._pending = RowRanges()
        self._buffer = []
        self._first_buffered_at = None
        self._extra_dirty = False

    def close(self) -> None:
        if not self._closed:
            self.commit()
            self._closed = True

    def __enter__(self) -> ArrowSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # buffered rows are finished results: keep them even when the job fails

    # parts

    def _write_part(self) -> PartEntry:
        table = self._table()
        stream = pa.BufferOutputStream()
        with pa.ipc.new_file(stream, table.schema) as writer:
            writer.write_table(table)
        data = stream.getvalue().to_pybytes()

        name = f"part-{self._next_part:05d}.arrow"
        tmp = self.out_dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out_dir / name)
        fsync_dir(self.out_dir)
        self._next_part += 1
        return PartEntry(name=name, num_rows=table.num_rows, rows=self._pending.to_json(), bytes=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), created=utc_now())

    def _table(self) -> pa.Table:
        arrays, fields = [], []
        for field in RESULT_SCHEMA:
            values = [row[field.name] for row in self._buffer]
            try:
                arrays.append(pa.array(values, type=field.type))
            except (pa.ArrowException, TypeError, OverflowError) as e:
                raise ValueError(f"result column {field.name!r} needs {field.type} values: {e}") from e
            fields.append(field)
        for name in self.keep_columns:
            array = self._kept_array(name, [row[name] for row in self._buffer])
            arrays.append(array)
            fields.append(pa.field(name, array.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def _kept_array(self, name: str, values: list) -> pa.Array:
        # A kept column's type is inferred from its first non-null part and reused; a later part
        # that does not fit widens it where Arrow can (null -> T, int -> float, new struct fields),
        # else the column turns to JSON text from then on. read_results() reconciles the parts.
        known = self._types.get(name)
        try:
            array = pa.array(values)
            target = known or array.type
            if known is not None and not pa.types.is_null(array.type) and array.type != known:
                target = unify_types(known, array.type)
            if target != array.type:
                array = pa.array(values, type=target)  # from the values: a cast cannot add struct fields
        except (pa.ArrowException, TypeError, OverflowError):
            array = pa.array(to_text(values), type=pa.string())
        if not pa.types.is_null(array.type):
            self._types[name] = array.type
        return array

    def _kept_types(self) -> dict[str, pa.DataType]:
        if not self.manifest.parts or not self.keep_columns:
            return {}
        with pa.memory_map(str(self.out_dir / self.manifest.parts[-1].name)) as source:
            schema = pa.ipc.open_file(source).schema
        return {f.name: f.type for f in schema if f.name in self.keep_columns and not pa.types.is_null(f.type)}

    # recovery

    def _recover(self) -> list[str]:
        listed = {part.name for part in self.manifest.parts}
        for path in self.out_dir.iterdir():
            orphan = PART_NAME.fullmatch(path.name) and path.name not in listed
            if orphan or TEMP_NAME.fullmatch(path.name):
                log.info("removing %s: written but never committed", path)
                path.unlink()
        repaired, kept = [], []
        for part in self.manifest.parts:
            path = self.out_dir / part.name
            size = path.stat().st_size if path.exists() else None
            if size == part.bytes:
                kept.append(part)
                continue
            repaired.append(part.name)
            log.warning("%s is %s; its %d rows will be generated again", path,
                        "missing" if size is None else f"{size} bytes, not {part.bytes}", part.num_rows)
            if size is not None:
                path.rename(path.with_name(path.name + ".corrupt"))
        self.manifest.parts = kept
        numbers = [int(PART_NAME.fullmatch(name).group(1)) for name in (*listed, *repaired)]
        self._next_part = max(numbers, default=-1) + 1
        return repaired


def _check_same_job(out_dir: Path, manifest: Manifest, fingerprint: dict, total_rows: int | None) -> None:
    if manifest.fingerprint != fingerprint:
        keys = sorted(k for k in {*manifest.fingerprint, *fingerprint}
                      if manifest.fingerprint.get(k) != fingerprint.get(k))
        raise FingerprintMismatch(f"{out_dir} holds results of a different job (differs in: {', '.join(keys)}); "
                                  "use a new output folder, or delete this one to start over")
    if manifest.total_rows is not None and total_rows is not None and manifest.total_rows != total_rows:
        raise FingerprintMismatch(f"{out_dir} was written for an input of {manifest.total_rows} rows, "
                                  f"the input now has {total_rows}; use a new output folder")


def to_text(values: list) -> list[str | None]:
    return [v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
            for v in values]


def unify_types(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    schema = pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])], promote_options="permissive")
    return schema.field("x").type


def read_results(out_dir: str | Path) -> pa.Table:
    """All committed rows of an output folder, sorted by row_index."""
    out_dir = Path(out_dir)
    manifest = Manifest.load(out_dir)
    if manifest is None:
        raise ManifestError(f"{out_dir} has no manifest.json; it is not a batchjob output folder (or nothing ran yet)")
    tables = []
    for part in manifest.parts:
        with pa.memory_map(str(out_dir / part.name)) as source:
            tables.append(pa.ipc.open_file(source).read_all())
    if not tables:
        return RESULT_SCHEMA.empty_table()
    return _concat(tables).sort_by("row_index")


def _concat(tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    # Some kept column changed type across parts in a way Arrow cannot widen: make it text.
    names = {f.name for t in tables for f in t.schema} - set(RESULT_SCHEMA.names)
    for name in names:
        types = [t.schema.field(name).type for t in tables if name in t.schema.names]
        try:
            for other in types[1:]:
                unify_types(types[0], other)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            tables = [_column_as_text(t, name) for t in tables]
    return pa.concat_tables(tables, promote_options="permissive")


def _column_as_text(table: pa.Table, name: str) -> pa.Table:
    if name not in table.schema.names:
        return table
    i = table.schema.get_field_index(name)
    text = pa.array(to_text(table.column(name).to_pylist()), type=pa.string())
    return table.set_column(i, pa.field(name, pa.string()), text)
