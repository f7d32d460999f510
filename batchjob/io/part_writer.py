"""PartWriter: one part file from a part's buffered result columns, built as Arrow arrays and written
durably under its final name (temp file, fsync, rename, fsync of the folder)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa

from batchjob.io.disk import disk
from batchjob.io.manifest import PartEntry, utc_now
from batchjob.io.parts import RESULT_SCHEMA, counts, encode_part, part_name, part_schema, to_text, unify_types
from batchjob.io.ranges import RowRanges
from batchjob.io.recovery import SinkError


class OutputError(SinkError, OSError):
    """Writing a part or the manifest failed (disk full, quota, I/O error). What was committed before
    stays committed and nothing half-written is left behind: the folder can be resumed."""


def output_error(path: Path, e: OSError) -> OutputError:
    err = OutputError(f"cannot write {path}: {e.strerror or e}; the rows committed before are kept and "
                      "nothing half-written is left: free space (or fix the folder) and rerun the same "
                      "command to continue")
    err.errno = e.errno  # ENOSPC / EDQUOT: the job records "disk full" for `batchjob status`
    return err


class PartWriter:
    def __init__(self, out_dir: Path, keep_columns: list[str], part_format: str, next_number: int,
                 last_part: Path | None, column_types: dict[str, pa.DataType] | None = None) -> None:
        self.out_dir, self.keep_columns, self.part_format = out_dir, keep_columns, part_format
        self.column_types = column_types or {}  # columns of a fixed type (an embedding's list<float32>)
        self.next_number = next_number
        # kept columns keep the types of the parts before (a resume reads the newest part's schema)
        self.types: dict[str, pa.DataType] = {}
        if last_part is not None and keep_columns:
            self.types = {f.name: f.type for f in part_schema(last_part)
                          if f.name in keep_columns and not pa.types.is_null(f.type)}

    def write(self, columns: dict[str, list], rows: RowRanges) -> PartEntry:
        data = encode_part(self.table(columns), self.part_format)
        name = part_name(self.next_number, self.part_format)
        try:  # a temp file, fsynced, renamed, the folder fsynced: a part under its name is whole
            disk().write_atomic(self.out_dir / name, data)
        except OSError as e:  # a renamed part whose folder fsync failed is never committed: removed on resume
            raise output_error(self.out_dir / name, e) from e
        self.next_number += 1
        return PartEntry(name=name, num_rows=len(columns["row_index"]), rows=rows.to_json(), bytes=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), created=utc_now(),
                         **counts(columns["finish_reason"], columns["prompt_tokens"], columns["completion_tokens"]))

    def table(self, columns: dict[str, list]) -> pa.Table:
        arrays, fields = [], []
        for field in RESULT_SCHEMA:
            try:
                arrays.append(pa.array(columns[field.name], type=field.type))
            except (pa.ArrowException, TypeError, OverflowError) as e:
                raise ValueError(f"result column {field.name!r} needs {field.type} values: {e}") from e
            fields.append(field)
        for name in self.keep_columns:
            typed = self.column_types.get(name)
            array = pa.array(columns[name], type=typed) if typed is not None else self._kept_array(name, columns[name])
            arrays.append(array)
            fields.append(pa.field(name, array.type))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def _kept_array(self, name: str, values: list) -> pa.Array:
        # A kept column's type is inferred from its first non-null part and reused; a later part
        # that does not fit widens it where Arrow can (null -> T, int -> float, new struct fields),
        # else the column turns to JSON text from then on. read_results() reconciles the parts.
        known = self.types.get(name)
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
            self.types[name] = array.type
        return array
