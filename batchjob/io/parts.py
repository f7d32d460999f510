"""Part files: the result schema, a part's name and format (Arrow IPC, or Parquet with --part-format),
encoding one, and reading parts back (one folder's rows sorted, schemas reconciled across parts).

Every reader of results goes through `read_part` / `part_schema`, so both formats read alike."""
from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io.manifest import Manifest, ManifestError, PartEntry, utc_now
from batchjob.io.part_format import PartFormat
from batchjob.io.ranges import RowRanges

RESULT_SCHEMA = pa.schema([
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("prompt_tokens", pa.int32()),
    pa.field("completion_tokens", pa.int32()),
    pa.field("error", pa.string()),
])
FINISH_REASONS = ("stop", "length", "error", "tool_calls")  # tool_calls: stopped after calls (a tool parser's)
PART_FORMATS = tuple(PartFormat)
PART_NAME = re.compile(r"part-(\d{5,})\.(arrow|parquet)")
TEMP_NAME = re.compile(r"\.(part-\d{5,}\.(arrow|parquet)|manifest\.json(\.prev)?)\.tmp")


def part_name(number: int, fmt: str) -> str:
    return f"part-{number:05d}.{fmt}"


def encode_part(table: pa.Table, fmt: str) -> bytes:
    """The bytes of a part: an Arrow IPC file (readable by pyarrow, pandas.read_feather, polars), or a
    Parquet file (zstd; readable by DuckDB, Spark, BigQuery with no extension)."""
    if fmt == PartFormat.PARQUET:
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        return sink.getvalue()
    stream = pa.BufferOutputStream()
    with pa.ipc.new_file(stream, table.schema) as writer:
        writer.write_table(table)
    return stream.getvalue().to_pybytes()


def read_part(path: Path) -> pa.Table:
    if path.suffix == ".parquet":
        return pq.read_table(path)
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def part_schema(path: Path) -> pa.Schema:
    if path.suffix == ".parquet":
        return pq.read_schema(path)
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).schema


def counts(finish_reasons: list, prompt_tokens: list, completion_tokens: list) -> dict:
    """What a manifest entry records about a part's rows, so `status` needs no part file."""
    return {"errors": sum(r == "error" for r in finish_reasons),
            "prompt_tokens": sum(t or 0 for t in prompt_tokens),
            "completion_tokens": sum(t or 0 for t in completion_tokens)}


def adopt_part(path: Path, done: RowRanges) -> PartEntry | None:
    """A manifest entry for an unlisted part that is a whole, valid result file whose rows no listed
    part holds; None when it is not."""
    data = path.read_bytes()
    try:
        if path.suffix == ".parquet":
            table = pq.read_table(pa.BufferReader(data))
        else:
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
                     sha256=hashlib.sha256(data).hexdigest(), created=utc_now(),
                     **counts(*(table.column(c).to_pylist() for c in ("finish_reason", "prompt_tokens", "completion_tokens"))))


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
        tables.append(read_part(out_dir / part.name))
    if not tables:
        return RESULT_SCHEMA.empty_table()
    return concat_parts(tables).sort_by("row_index")


def concat_parts(tables: list[pa.Table]) -> pa.Table:
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
