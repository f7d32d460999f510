"""ArrowSink: writes result rows into an output folder as Arrow IPC part files plus manifest.json.

Commit protocol: a part is written under a temp name, fsynced and renamed, then one record listing
it is appended to the commit log (io/commit_log.py) and fsynced; when the log outgrows manifest.json,
a new snapshot replaces it. Only listed parts count, so a crash anywhere loses at most the rows still
buffered, and reopening the folder sweeps away what the crash left behind.

Reopening checks the size of every listed part and the SHA-256 of the last ones (what a crash can have
touched): the time to resume does not grow with the output. `batchjob verify` hashes every part. A
damaged part is set aside (`.corrupt`) and its rows are generated again. A damaged manifest is rebuilt
from the previous snapshot (manifest.json.prev) and the logs, plus the part files they do not list,
each checked to be a whole Arrow file whose rows no other part holds; nothing verifiable is dropped.
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

from dataclasses import asdict

from batchjob.io.commit_log import CommitLog
from batchjob.io.manifest import (MANIFEST, PREVIOUS, VERSION, Manifest, ManifestError, ManifestVersionError, PartEntry,
                                  fsync_dir, utc_now)
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
TEMP_NAME = re.compile(r"\.(part-\d{5,}\.arrow|manifest\.json(\.prev)?)\.tmp")
RESUME_POSITION = "resume_position"  # manifest extra: where a reader resumes (first row not committed)
COMPACT_MIN_BYTES = 256 << 10  # the log is folded into a new snapshot once it is larger than this and the snapshot
VERIFY_LAST = 2  # listed parts hashed on reopening (the newest: what a crash can have left torn); all are sized


class SinkError(Exception):
    """The output folder cannot be used: not creatable, corrupt manifest, another job's results."""


class FingerprintMismatch(SinkError):
    """The output folder holds results of a different job."""


class OutputError(SinkError, OSError):
    """Writing a part or the manifest failed (disk full, quota, I/O error). What was committed before
    stays committed and nothing half-written is left behind: the folder can be resumed."""


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
            manifest, self.damaged_manifest = _load_manifest(self.out_dir)
        except OSError as e:
            raise SinkError(f"cannot use output folder {self.out_dir}: {e}") from e

        fingerprint = json.loads(json.dumps(fingerprint))  # compare as it will read back
        fresh = manifest is None
        upgraded = False
        if manifest is None:
            manifest = Manifest(fingerprint=fingerprint, total_rows=total_rows)
        else:
            upgraded = _check_same_job(self.out_dir, manifest, fingerprint, total_rows)
            manifest.total_rows = manifest.total_rows if total_rows is None else total_rows
        self.manifest = manifest
        # names of listed parts that were missing or damaged; with a damaged manifest, the parts adopted
        self.repaired, self.adopted = self._recover(adopt=self.damaged_manifest is not None)

        self.done: RowRanges = manifest.done_rows()  # committed rows only
        self._pending = RowRanges()
        self._buffer: list[dict] = []
        self._first_buffered_at: float | None = None
        self._dirty: set[str] = set()  # extra keys set since the last commit
        self._total_dirty = False
        self._closed = False
        self._positions: dict[int, object] = {}  # row read but not committed -> where reading it again starts
        self._types = self._kept_types()
        self._log = CommitLog(self.out_dir)  # cuts off a torn last record
        snapshot = self.out_dir / MANIFEST
        self._snapshot_bytes = snapshot.stat().st_size if snapshot.exists() else 0
        if fresh or self.repaired or self.damaged_manifest or upgraded or manifest.version != VERSION:
            # marks the folder as this job's before any part exists; an older format is written anew
            self._compact()

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
        self._dirty.add(key)

    @property
    def extra(self) -> dict:
        return self.manifest.extra

    def set_total_rows(self, total: int) -> None:
        """The input's row count once known (a JSONL file read to its end); stored at the next commit."""
        if self.manifest.total_rows != total:
            self.manifest.total_rows = total
            self._total_dirty = True

    def note_position(self, row_index: int, position) -> None:
        """Where a reader starts to read `row_index` again (JSON-able, opaque here: a JSONL
        (row, byte offset)). Each commit stores the position of the first row not committed as
        extra["resume_position"]. Held only until the row is committed, so memory stays bounded by the
        rows in flight plus one part."""
        self._positions[row_index] = position

    def commit(self) -> None:
        """Write the buffered rows as a part and append its record to the commit log (one fsync each)."""
        if not self._buffer and not self._dirty and not self._total_dirty:
            return
        listed, extra, seq = self.manifest.parts, dict(self.manifest.extra), self.manifest.seq
        done = self.done.union(self._pending)
        dirty = {*self._dirty, "last_commit"}
        position = self._positions.get(done.first_missing())
        if position is not None:
            self.manifest.extra[RESUME_POSITION] = position
            dirty.add(RESUME_POSITION)
        self.manifest.extra["last_commit"] = time.time()
        try:
            record: dict = {"seq": seq + 1, "extra": {k: self.manifest.extra[k] for k in sorted(dirty)}}
            if self._total_dirty:
                record["total_rows"] = self.manifest.total_rows
            entry = self._write_part() if self._buffer else None
            if entry is not None:
                record["part"] = asdict(entry)
            try:
                self._log.append(record)
            except OSError as e:
                raise _output_error(self._log.path, e) from e
        except BaseException:
            # a written part stays an orphan, removed on resume
            self.manifest.parts, self.manifest.extra = listed, extra
            raise
        if entry is not None:
            self.manifest.parts = [*listed, entry]
        self.manifest.seq = seq + 1
        for start, end in self._pending.ranges():
            for row in range(start, end):
                self._positions.pop(row, None)
        self.done = done
        self._pending = RowRanges()
        self._buffer = []
        self._first_buffered_at = None
        self._dirty = set()
        self._total_dirty = False
        if self._log.bytes > max(COMPACT_MIN_BYTES, self._snapshot_bytes):
            self._compact()  # the commit above is durable already: a failure here loses nothing

    def _compact(self) -> None:
        try:
            self._snapshot_bytes = self.manifest.commit(self.out_dir)
        except OSError as e:
            raise _output_error(self.out_dir / MANIFEST, e) from e
        self._log = CommitLog(self.out_dir)  # the old one became commits.log.prev

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
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_dir / name)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _output_error(self.out_dir / name, e) from e
        fsync_dir(self.out_dir)
        self._next_part += 1
        return PartEntry(name=name, num_rows=table.num_rows, rows=self._pending.to_json(), bytes=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), created=utc_now(), **_counts(self._buffer))

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

    def _recover(self, adopt: bool) -> tuple[list[str], list[str]]:
        """Sweep temp files and unlisted parts (adopt verifiable ones instead when the manifest was
        rebuilt from its previous generation), and set aside listed parts that fail their checksum."""
        listed = {part.name for part in self.manifest.parts}
        unlisted = []
        for path in sorted(self.out_dir.iterdir()):
            if TEMP_NAME.fullmatch(path.name):
                log.info("removing %s: written but never committed", path)
                path.unlink()
            elif PART_NAME.fullmatch(path.name) and path.name not in listed:
                unlisted.append(path)
        repaired, kept = [], []
        hashed = {p.name for p in self.manifest.parts[-VERIFY_LAST:]} if not adopt else listed
        for part in self.manifest.parts:
            path = self.out_dir / part.name
            problem = _check_part(path, part, full=part.name in hashed)
            if problem is None:
                kept.append(part)
                continue
            repaired.append(part.name)
            log.warning("%s is %s; its %d rows will be generated again", path, problem, part.num_rows)
            if path.exists():
                path.rename(path.with_name(path.name + ".corrupt"))
        self.manifest.parts = kept
        adopted = []
        done = self.manifest.done_rows()
        for path in unlisted:
            entry = _adopt_part(path, done) if adopt else None
            if entry is None:
                log.info("removing %s: written but never committed", path)
                path.unlink()
                continue
            log.warning("%s was not in the previous manifest; verified and kept (%d rows)", path, entry.num_rows)
            self.manifest.parts.append(entry)
            done = done.union(entry.row_ranges())
            adopted.append(path.name)
        self.manifest.parts.sort(key=lambda p: p.name)
        numbers = [int(PART_NAME.fullmatch(name).group(1)) for name in (*listed, *repaired, *adopted)]
        self._next_part = max(numbers, default=-1) + 1
        return repaired, adopted


START_OVER = ("rerun the original job unchanged to continue it, or add --restart to delete this folder's "
              "results and start over, or write to another --output folder")


def same_job(old: dict, new: dict) -> bool:
    """Fingerprints of the same job. An input identity written before inputs were fingerprinted by content
    (the path, then [name, size, mtime] per file) still matches when the names, sizes and columns do:
    a folder from an earlier version resumes without --restart."""
    if old == new:
        return True
    o, n = old.get("input"), new.get("input")
    if not (isinstance(o, dict) and isinstance(n, dict) and "path" in o and "format" not in o):
        return False
    legacy = [f[:2] for f in o.get("files", [])] == [f[:2] for f in n.get("files", [])] and o.get("columns") == n.get("columns")
    return legacy and {**old, "input": None} == {**new, "input": None}


def _check_same_job(out_dir: Path, manifest: Manifest, fingerprint: dict, total_rows: int | None) -> bool:
    """Raises when `manifest` is another job's; True when its fingerprint was of an older form (now updated)."""
    upgraded = manifest.fingerprint != fingerprint
    if same_job(manifest.fingerprint, fingerprint):
        manifest.fingerprint = fingerprint
    else:
        changes = fingerprint_changes(manifest.fingerprint, fingerprint)
        raise FingerprintMismatch(f"{out_dir} holds results of a different job (differs in: {'; '.join(changes)}); "
                                  + START_OVER)
    if manifest.total_rows is not None and total_rows is not None and manifest.total_rows != total_rows:
        raise FingerprintMismatch(f"{out_dir} was written for an input of {manifest.total_rows} rows, "
                                  f"the input now has {total_rows}; " + START_OVER)
    return upgraded


_ABSENT = object()


def fingerprint_changes(old: dict, new: dict, limit: int = 8) -> list[str]:
    """What differs between two fingerprints, as 'path: old -> new' lines (at most `limit`)."""
    changes: list[str] = []

    def walk(a, b, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted({*a, *b}, key=str):
                x, y = a.get(key, _ABSENT), b.get(key, _ABSENT)
                if x != y:
                    walk(x, y, f"{path}.{key}" if path else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and not (_flat(a) and _flat(b)):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    walk(x, y, f"{path}[{i}]")
        else:
            changes.append(f"{path}: {_short(a)} -> {_short(b)}")

    walk(old, new, "")
    more = len(changes) - limit
    return changes[:limit] + ([f"and {more} more"] if more > 0 else [])


def _flat(value: list) -> bool:
    """A list of plain values (an input file's [name, bytes, mtime], a column list) is shown whole."""
    return not any(isinstance(v, (dict, list)) for v in value)


def _short(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _load_manifest(out_dir: Path) -> tuple[Manifest | None, str | None]:
    """The committed manifest, or None for a fresh folder. When manifest.json is damaged (or gone while
    a previous generation exists), the previous generation and why; the damaged file is kept aside."""
    try:
        manifest = Manifest.load(out_dir)
        if manifest is not None:
            return manifest, None
        problem = f"{out_dir / MANIFEST} is missing"
    except ManifestVersionError as e:
        raise SinkError(f"{e}: use that batchjob version for this folder, or another output folder") from e
    except ManifestError as e:
        problem = str(e)
    try:
        previous = Manifest.load(out_dir, PREVIOUS)
    except ManifestError as e:
        raise SinkError(f"{problem}, and its previous generation is damaged too ({e}); the results in {out_dir} "
                        "cannot be verified: add --restart to delete them and start over, or use another output folder") from e
    if previous is None:
        if (out_dir / MANIFEST).exists():
            raise SinkError(f"{problem}; there is no previous generation to repair it from: add --restart to "
                            "delete this folder's results and start over, or use another output folder")
        if any(PART_NAME.fullmatch(p.name) for p in out_dir.iterdir()):
            raise SinkError(f"{out_dir} holds part files but no manifest.json, so they cannot be verified; add "
                            "--restart to delete them and start over, or use another output folder")
        return None, None
    if (out_dir / MANIFEST).exists():
        os.replace(out_dir / MANIFEST, out_dir / (MANIFEST + ".corrupt"))
    log.warning("%s; rebuilding it from %s and the part files it does not list", problem, PREVIOUS)
    return previous, problem


def _check_part(path: Path, part: PartEntry, full: bool = True) -> str | None:
    """None when the part is whole: its size, and with `full` its SHA-256, as listed."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != part.bytes:
        return f"{size} bytes, not {part.bytes}"
    if not full:
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != part.sha256:
        return "damaged (SHA-256 mismatch)"
    return None


def _adopt_part(path: Path, done: RowRanges) -> PartEntry | None:
    """A manifest entry for an unlisted part that is a whole, valid result file whose rows no listed
    part holds; None when it is not."""
    data = path.read_bytes()
    try:
        table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError):
        return None
    if table.schema.names[: len(RESULT_SCHEMA)] != RESULT_SCHEMA.names:
        return None
    rows = RowRanges()
    for index in table.column("row_index").to_pylist():
        if index is None or index in done or index in rows:
            return None
        rows.add_row(index)
    return PartEntry(name=path.name, num_rows=table.num_rows, rows=rows.to_json(), bytes=len(data),
                     sha256=hashlib.sha256(data).hexdigest(), created=utc_now(), **_counts(table.to_pylist()))


def _counts(rows: list[dict]) -> dict:
    return {"errors": sum(r["finish_reason"] == "error" for r in rows),
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in rows)}


def _output_error(path: Path, e: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {e.strerror or e}; the rows committed before are kept and "
                       "nothing half-written is left: free space (or fix the folder) and rerun the same "
                       "command to continue")


def clear_results(out_dir: str | Path) -> int:
    """Delete what batchjob wrote in `out_dir` (parts, manifests, temp and set-aside files); other files
    stay. Returns how many files went."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return 0
    ours = re.compile(r"(part-\d{5,}\.(arrow|parquet)|manifest\.json(\.prev)?|commits\.log(\.prev)?)(\.corrupt)?")
    removed = 0
    for path in out_dir.iterdir():
        if path.is_file() and (ours.fullmatch(path.name) or TEMP_NAME.fullmatch(path.name)):
            path.unlink()
            removed += 1
    return removed


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
