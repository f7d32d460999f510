"""Merging result parts back into input order, for every export: the rows of a set of parts streamed in
row_index order, one schema for them all, and writing them to one .parquet / .jsonl / .arrow file.

Parts hold rows in completion order, so each part is sorted on its own (a part is at most part_rows
rows) and the parts are merged with a heap. A part is opened only when the merge reaches its first row
(known from the manifest) and let go after its last, so memory is a few parts, whatever the row count.
The file is written under a temporary name and renamed: a reader never sees half an export.
"""
from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from batchjob.io.disk import File, disk
from batchjob.io.manifest import PartEntry
from batchjob.io.parts import RESULT_SCHEMA, concat_parts, part_schema, read_part, to_text, unify_types

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".arrow": "arrow",
           ".feather": "arrow"}
CHUNK_ROWS = 8192  # rows per write


class ExportError(Exception):
    """The rows cannot be exported as asked (rows missing, not an output folder, unknown format)."""


def write_merged(folder: Path, parts: list[PartEntry], to: Path, kind: str, *, chunk_rows: int = CHUNK_ROWS,
                 check: Callable[[int], None] | None = None) -> int:
    """Write the rows of `parts` (their names relative to `folder`) in row_index order to `to`, as `kind`
    (a value of FORMATS); `check(rows written)` may refuse the file (raise) before it takes `to`'s name.
    Returns the rows written."""
    schema = merged_schema(folder, parts)
    rows = 0
    layer = disk()
    tmp = to.with_name(f".{to.name}.tmp-{os.getpid()}")
    try:
        with File(layer, tmp) as file, _Writer(kind, file, schema) as writer:
            for table in merge_parts(folder, parts, chunk_rows):
                writer.write(conform(table, schema))
                rows += table.num_rows
        if check is not None:
            check(rows)
        layer.rename(tmp, to)
    except BaseException:
        layer.discard(tmp)
        raise
    layer.fsync_dir(to.parent)  # the export's name, durable before the command says it is written
    return rows


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


def merge_parts(folder: Path, parts: list[PartEntry], chunk_rows: int) -> Iterator[pa.Table]:
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


def merged_schema(folder: Path, parts: list[PartEntry]) -> pa.Schema:
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


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """The table with exactly `schema`'s columns: a missing one null, one of another type cast to it."""
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


class _Guarded:
    """The file as pyarrow's writers see it: an OSError is kept here and raised by _Writer once pyarrow has
    returned, never thrown through pyarrow's C++ callback (on Python 3.11 an exception crossing it left the
    interpreter's AST recursion counter off, and every later ast.parse failed). Writes after an error are
    dropped: the file is discarded."""

    def __init__(self, file: File) -> None:
        self.file, self.error = file, None
        self.mode = "wb"

    closed = property(lambda self: self.file.closed)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        pass

    def write(self, data) -> int:
        if self.error is None:
            try:
                return self.file.write(data)
            except OSError as e:
                self.error = e
        return len(data)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Writer:
    def __init__(self, kind: str, file: File, schema: pa.Schema) -> None:
        self.kind, self.file, self.schema = kind, file, schema
        self.guarded = _Guarded(file)
        self.writer = None
        if kind == "parquet":
            import pyarrow.parquet as pq

            self.writer = pq.ParquetWriter(self.guarded, schema)
        elif kind == "arrow":
            self.writer = pa.ipc.new_file(self.guarded, schema)
        self.guarded.raise_error()

    def write(self, table: pa.Table) -> None:
        if self.kind == "jsonl":
            lines = "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in table.to_pylist())
            self.file.write(lines.encode())
        else:
            self.writer.write_table(table)
            self.guarded.raise_error()

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Close the writer (the footer), then fsync the file; the caller closes it."""
        if self.writer is not None:
            self.writer.close()
        self.guarded.raise_error()
        if exc_type is None:
            self.file.sync()
