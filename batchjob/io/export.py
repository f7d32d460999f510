"""Export: the committed rows of an output folder as one file (.parquet, .jsonl, .arrow) in input order.

Parts hold rows in completion order, so each part is sorted on its own (a part is at most part_rows
rows) and the parts are merged with a heap. A part is opened only when the merge reaches its first row
(known from the manifest) and let go after its last, so memory is a few parts, whatever the row count.
The file is written under a temporary name and renamed: a reader never sees half an export.
"""
from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchjob.io.manifest import Manifest, ManifestError, PartEntry, fsync_dir, result_folders
from batchjob.io.ranges import RowRanges
from batchjob.io.parts import RESULT_SCHEMA, part_schema, read_part, to_text, unify_types
from batchjob.io.parts import concat_parts

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".arrow": "arrow",
           ".feather": "arrow"}
CHUNK_ROWS = 8192  # rows per write


class ExportError(Exception):
    """The folder cannot be exported as asked (rows missing, not an output folder, unknown format)."""


@dataclass(slots=True)
class ExportSummary:
    rows: int
    missing: RowRanges  # rows of [0, total) left out (only with partial=True)
    total_rows: int | None
    path: Path


def export(out: str | Path, to: str | Path, *, partial: bool = False, chunk_rows: int = CHUNK_ROWS) -> ExportSummary:
    """Write every committed row of the output folder `out`, sorted by row_index, to `to`. Refuses
    when input rows are missing (naming them), unless `partial`."""
    out, to = Path(out), Path(to)
    kind = FORMATS.get(to.suffix.lower())
    if kind is None:
        raise ExportError(f"--to {to}: unknown format {to.suffix!r}; use a file name ending in .parquet, .jsonl or .arrow")
    folder = _one_folder(out)
    try:
        manifest = Manifest.load(folder)
    except ManifestError as e:
        raise ExportError(f"{e}; rerun the job on it (it repairs the manifest from manifest.json.prev) and export again") from e
    done = manifest.done_rows()
    total = manifest.total_rows
    missing = missing_rows(manifest) or RowRanges()
    if not partial:
        if total is None:
            raise ExportError(f"{folder} holds {done.count()} rows, but the job has not read its input to the end, so "
                              "the number of input rows is unknown; rerun the job to finish it, or pass --partial")
        if missing:
            raise ExportError(f"{folder} lacks {missing.count()} of {total} rows: {describe(missing)}; rerun the job "
                              "to finish it, or pass --partial to export the committed rows only")
    schema = _schema(folder, manifest.parts)
    rows = 0
    tmp = to.with_name(f".{to.name}.tmp-{os.getpid()}")
    try:
        with _Writer(kind, tmp, schema) as writer:
            for table in _merged(folder, manifest.parts, chunk_rows):
                writer.write(_conform(table, schema))
                rows += table.num_rows
        os.replace(tmp, to)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(to.parent)
    return ExportSummary(rows, missing, total, to)


def missing_rows(manifest: Manifest) -> RowRanges | None:
    """The input rows the folder should hold but does not; None while their number is unknown. A
    shard's folder holds its slice [start, end) of the input (recorded in its fingerprint)."""
    if manifest.total_rows is None:
        return None
    shard = manifest.fingerprint.get("shard")
    start = shard.get("start", 0) if isinstance(shard, dict) else 0
    end = start + manifest.total_rows
    return RowRanges((max(s, start), e) for s, e in manifest.done_rows().missing(end).ranges() if e > start)


def describe(rows: RowRanges, most: int = 5) -> str:
    """'3, 10-19 and 4 more ranges' (inclusive, as people count rows)."""
    spans = rows.ranges()
    shown = ", ".join(f"{s}-{e - 1}" if e - s > 1 else str(s) for s, e in spans[:most])
    return shown + (f" and {len(spans) - most} more ranges" if len(spans) > most else "")


def _one_folder(out: Path) -> Path:
    folders = result_folders(out) if out.is_dir() else []
    if not folders:
        raise ExportError(f"{out} has no manifest.json (nor a folder below it); it is not a batchjob output folder, or nothing ran yet")
    if len(folders) > 1:
        names = ", ".join(str(f.relative_to(out)) for f in folders)
        raise ExportError(f"{out} holds several result folders ({names}), each with its own input (per-lane inputs); "
                          f"export each one, e.g. batchjob export {folders[0]} --to FILE")
    return folders[0]


# merging


class _Part:
    """One part, sorted by row_index: the Arrow table (memory-mapped) and its sort order."""

    def __init__(self, path: Path) -> None:
        self.table = read_part(path)  # an Arrow part stays memory-mapped
        index = self.table.column("row_index").to_numpy()
        self.order = np.argsort(index, kind="stable")
        self.rows = index[self.order]
        self.pos = 0

    @property
    def next_row(self) -> int:
        return int(self.rows[self.pos])

    def take_below(self, limit: float) -> pa.Table:
        """The part's next rows whose row_index is below `limit`."""
        end = int(np.searchsorted(self.rows, limit, side="left")) if limit != float("inf") else len(self.rows)
        end = max(end, self.pos + 1)
        piece = self.table.take(pa.array(self.order[self.pos:end]))
        self.pos = end
        return piece

    def close(self) -> None:
        self.table = None  # the mapping goes with the last reference to its buffers


def _merged(folder: Path, parts: list[PartEntry], chunk_rows: int) -> Iterator[pa.Table]:
    """Tables of about chunk_rows rows, in row_index order, over all parts."""
    waiting = sorted((min(s for s, _ in p.rows) if p.rows else 0, i) for i, p in enumerate(parts))
    heap: list[tuple[int, int, _Part]] = []
    pieces: list[pa.Table] = []
    buffered = 0
    last = -1
    w = 0
    while heap or w < len(waiting):
        while w < len(waiting) and (not heap or waiting[w][0] <= heap[0][0]):
            part = _Part(folder / parts[waiting[w][1]].name)
            if len(part.rows):
                heapq.heappush(heap, (part.next_row, waiting[w][1], part))
            w += 1
        if not heap:
            continue
        row, i, part = heapq.heappop(heap)
        if row <= last:
            raise ExportError(f"row {row} is in more than one part of {folder}; the folder was edited by hand")
        limit = min(heap[0][0] if heap else float("inf"), waiting[w][0] if w < len(waiting) else float("inf"))
        piece = part.take_below(limit)
        last = int(piece.column("row_index")[-1].as_py())
        pieces.append(piece)
        buffered += piece.num_rows
        if part.pos < len(part.rows):
            heapq.heappush(heap, (part.next_row, i, part))
        else:
            part.close()
        if buffered >= chunk_rows:
            yield _concat(pieces)
            pieces, buffered = [], 0
    if pieces:
        yield _concat(pieces)


def _concat(pieces: list[pa.Table]) -> pa.Table:
    return concat_parts(pieces) if len(pieces) > 1 else pieces[0]  # a kept column typed apart turns to text


# one schema for all parts


def _schema(folder: Path, parts: list[PartEntry]) -> pa.Schema:
    """Result columns, then the kept columns in first-seen order; a kept column whose types across
    parts cannot be widened into one becomes text (as read_results does). Reads part footers only."""
    types: dict[str, pa.DataType | None] = {}
    for part in parts:
        schema = part_schema(folder / part.name)
        for field in schema:
            if field.name in RESULT_SCHEMA.names:
                continue
            known = types.get(field.name)
            if field.name not in types or known is None or pa.types.is_null(known):
                types[field.name] = field.type
            elif not pa.types.is_null(field.type) and field.type != known:
                try:
                    types[field.name] = unify_types(known, field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    types[field.name] = pa.string()
    return pa.schema([*RESULT_SCHEMA, *(pa.field(name, t) for name, t in types.items())])


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    arrays = []
    for field in schema:
        if field.name not in table.schema.names:
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        if column.type != field.type:
            if pa.types.is_string(field.type):
                column = pa.array(to_text(column.to_pylist()), type=pa.string())
            else:
                try:
                    column = column.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    column = pa.array(column.to_pylist(), type=field.type)  # e.g. a struct gaining fields
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=schema)


# writing


class _Writer:
    def __init__(self, kind: str, path: Path, schema: pa.Schema) -> None:
        self.kind, self.path, self.schema = kind, path, schema
        self.file = open(path, "wb")
        self.writer = None
        if kind == "parquet":
            import pyarrow.parquet as pq

            self.writer = pq.ParquetWriter(self.file, schema)
        elif kind == "arrow":
            self.writer = pa.ipc.new_file(self.file, schema)

    def write(self, table: pa.Table) -> None:
        if self.kind == "jsonl":
            lines = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in table.to_pylist())
            self.file.write(lines.encode())
        else:
            self.writer.write_table(table)

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
