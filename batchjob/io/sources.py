"""Input sources: stream rows of a JSONL file, Parquet file/folder or `datasets` save_to_disk folder.

Each source yields `InputRow`s in input order with a 0-based `row_index`, reads ahead a bounded
amount (one chunk / one record batch), and does not read rows a resume asks it to skip where the
format allows (whole Parquet row groups and files; a JSONL byte offset).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io.ranges import RowRanges

FORMATS = {"jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "parquet": "parquet", "datasets": "datasets",
           "openai-batch": "openai-batch"}
SUPPORTED = "JSON Lines (.jsonl/.json/.ndjson), Parquet (.parquet file or a folder of them), a `datasets` save_to_disk folder"


@dataclass(slots=True)
class InputRow:
    row_index: int  # 0-based position in the whole input
    record: dict | None  # column -> python value; None when the row could not be parsed
    error: str | None = None  # per-row problem, e.g. "data.jsonl line 17: invalid JSON: ..."


class SourceError(Exception):
    """A job-level input problem; the message names the file and what to do."""


class Source:
    format_name: ClassVar[str] = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = []
        self.num_rows: int | None = None

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


def validate_columns(source: Source, required: list[str]) -> None:
    missing = [c for c in required if c not in source.columns]
    if not missing:
        return
    what = ("column " if len(missing) == 1 else "columns ") + ", ".join(repr(c) for c in missing)
    available = ", ".join(source.columns) or "(none)"
    hint = f" (taken from the first {JsonlSource.sample_lines} lines)" if isinstance(source, JsonlSource) else ""
    raise SourceError(f"{what} not found in {source.path}; available columns{hint}: {available}")


def open_source(path: str | Path, *, input_format: str | None = None) -> Source:
    path = Path(path)
    if not path.exists():
        raise SourceError(f"input not found: {path} (check the input path in the job file)")
    kind = _detect(path) if input_format is None else FORMATS.get(input_format.lower())
    if kind is None:
        raise SourceError(f"unknown input_format {input_format!r}; use one of: {', '.join(sorted(FORMATS))}")
    try:
        if kind == "jsonl" and input_format is None and _first_line_is_openai_batch(path):
            kind = "openai-batch"
        if kind == "openai-batch":
            from batchjob.io.openai_batch import OpenAIBatchSource  # it builds on JsonlSource

            return OpenAIBatchSource(path)
        return {"jsonl": JsonlSource, "parquet": ParquetSource, "datasets": DatasetsSource}[kind](path)
    except PermissionError as e:
        raise SourceError(f"cannot read {path}: permission denied ({e.filename})") from e


def _first_line_is_openai_batch(path: Path) -> bool:
    from batchjob.io.openai_batch import is_openai_batch_line

    with open(path, "rb") as f:  # decided by the first line that parses (a bad first line is a row error)
        for _, line in zip(range(100), f):
            try:
                return is_openai_batch_line(json.loads(line)) if line.strip() else None
            except ValueError:
                continue
    return False


def _detect(path: Path) -> str:
    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            splits = _dataset_dict_splits(path)
            raise SourceError(
                f"{path} is a DatasetDict with splits {', '.join(splits)}; "
                f"point the input at one split, e.g. {path / splits[0] if splits else path / 'train'}")
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            return "datasets"
        if any(path.glob("*.parquet")):
            return "parquet"
        raise SourceError(f"{path} is a folder with no *.parquet files and no datasets state.json; supported: {SUPPORTED}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise SourceError(f"cannot tell the format of {path} from its name; supported: {SUPPORTED}; "
                      "or set input_format to one of: jsonl, parquet, datasets")


def _dataset_dict_splits(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p.name for p in path.iterdir() if (p / "state.json").exists())


def _narrow(record: dict, columns: list[str] | None) -> dict:
    return record if columns is None else {c: record[c] for c in columns if c in record}


def _batch_rows(batch: pa.RecordBatch, first_row: int, skip: RowRanges | None,
                batch_rows: int) -> Iterator[InputRow]:
    # Convert at most batch_rows rows to Python at a time; slices are zero-copy.
    for offset in range(0, batch.num_rows, batch_rows):
        start = first_row + offset
        piece = batch.slice(offset, batch_rows)
        if skip is not None and skip.covers(start, start + piece.num_rows):
            continue
        for i, record in enumerate(piece.to_pylist()):
            if skip is None or start + i not in skip:
                yield InputRow(start + i, record)


class JsonlSource(Source):
    """One JSON object per line. A blank line is not a row: row_index counts non-blank lines, the
    same on a fresh run and on a resume from a byte offset."""

    format_name = "JSONL"
    sample_lines: ClassVar[int] = 100  # lines read up front to learn the columns
    chunk_bytes: int = 1 << 20  # read-ahead; the buffer holds one chunk plus one partial line

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        if path.is_dir():
            raise SourceError(f"{path} is a folder; JSONL input must be a file")
        self._position = (0, 0)
        self.peak_buffer_bytes = 0  # largest read-ahead held so far (tests pin the bound)
        self.columns = self._sample_columns()

    def position(self) -> tuple[int, int]:
        """(next row_index, byte offset just past the last yielded row): pass it back as
        `start_offset` to resume there. Valid after each row the current `rows()` yielded."""
        return self._position

    def row_ends(self) -> Iterator[int]:
        """The byte offset just past each row's line, in row order, without parsing a line: row r
        starts at (r, ends[r - 1]) (shard planning)."""
        with open(self.path, "rb") as f:
            for line, _, end in self._lines(f, 0):
                if line.strip():
                    yield end

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None,
             start_offset: tuple[int, int] | None = None) -> Iterator[InputRow]:
        row_index, offset = start_offset or (0, 0)
        name = self.path.name
        with open(self.path, "rb") as f:
            if offset:
                self._check_line_start(f, offset)
            f.seek(offset)
            self._position = (row_index, offset)
            line_no = 1 if offset == 0 else None  # unknown after a seek: errors then cite the byte
            for line, start, end in self._lines(f, offset):
                if line.strip():
                    if skip is None or row_index not in skip:
                        where = f"{name} line {line_no}" if line_no else f"{name} byte {start}"
                        row = self._parse(row_index, line, where, columns)
                        self._position = (row_index + 1, end)
                        yield row
                    else:
                        self._position = (row_index + 1, end)
                    row_index += 1
                if line_no:
                    line_no += 1

    def _parse(self, row_index: int, line: bytes, where: str, columns: list[str] | None) -> InputRow:
        try:
            value = json.loads(line)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            return InputRow(row_index, None, f"{where}: invalid JSON: {e}")
        if not isinstance(value, dict):
            return InputRow(row_index, None, f"{where}: expected a JSON object, got {type(value).__name__}")
        return InputRow(row_index, _narrow(value, columns))

    def _lines(self, f, offset: int) -> Iterator[tuple[bytes, int, int]]:
        """(line without its newline, start offset, offset just past the newline)."""
        pending = bytearray()
        first = offset == 0
        while chunk := f.read(self.chunk_bytes):
            if first and chunk.startswith(b"\xef\xbb\xbf"):  # UTF-8 BOM
                chunk, offset = chunk[3:], offset + 3
            first = False
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, len(pending) + len(chunk))
            start = 0
            while (nl := chunk.find(b"\n", start)) >= 0:
                if pending:
                    pending += chunk[start:nl]
                    line, pending = bytes(pending), bytearray()
                else:
                    line = chunk[start:nl]
                end = offset + nl + 1
                yield line.rstrip(b"\r"), end - len(line) - 1, end
                start = nl + 1
            pending += chunk[start:]
            offset += len(chunk)
        if pending:  # last line without a trailing newline
            yield bytes(pending).rstrip(b"\r"), offset - len(pending), offset

    def _check_line_start(self, f, offset: int) -> None:
        f.seek(offset - 1)
        before = f.read(1)
        if before != b"\n":
            raise SourceError(f"resume offset {offset} is not at a line start in {self.path}; "
                              "the input file changed since the run started — rerun into a new output folder")

    def _sample_columns(self) -> list[str]:
        columns: dict[str, None] = {}
        seen, objects, first = 0, 0, b""
        with open(self.path, "rb") as f:
            for line, _, _ in self._lines(f, 0):
                if not line.strip():
                    continue
                first = first or line.lstrip()
                seen += 1
                try:
                    value = json.loads(line)
                except ValueError:
                    value = None
                if isinstance(value, dict):
                    objects += 1
                    columns.update(dict.fromkeys(value))
                if seen >= self.sample_lines:
                    break
        if seen and not objects:
            shape = "a JSON array" if first.startswith(b"[") else "not JSON Lines"
            raise SourceError(f"{self.path} looks like {shape}: none of its first {seen} lines is a JSON object; "
                              "write one JSON object per line (JSON Lines)")
        self.peak_buffer_bytes = 0
        return list(columns)


class ParquetSource(Source):
    """A .parquet file or a folder of them (sorted by name), read one row group at a time."""

    format_name = "Parquet"
    batch_rows: int = 1024  # rows converted to Python at once

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not self.files:
            raise SourceError(f"{path} holds no *.parquet files")
        self._row_groups: list[list[int]] = []  # per file: rows in each row group
        for file in self.files:
            try:
                meta = pq.read_metadata(file)
                names = meta.schema.to_arrow_schema().names
            except PermissionError:
                raise
            except (pa.ArrowException, OSError) as e:
                raise SourceError(f"cannot read {file} as Parquet: {e}") from e
            if file is self.files[0]:
                self.columns = names
            elif names != self.columns:
                raise SourceError(f"{file} has columns {', '.join(names)} but {self.files[0].name} has "
                                  f"{', '.join(self.columns)}; all files of a Parquet folder need the same columns")
            self._row_groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        self.num_rows = sum(sum(groups) for groups in self._row_groups)

    def unit_starts(self) -> list[int]:
        starts, row = [], 0
        for groups in self._row_groups:
            for n in groups:
                starts.append(row)
                row += n
        return starts or [0]

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        first_row = 0
        for file, groups in zip(self.files, self._row_groups):
            file_rows = sum(groups)
            if skip is not None and skip.covers(first_row, first_row + file_rows):
                first_row += file_rows
                continue  # never opened
            with pq.ParquetFile(file) as pf:
                for i, n in enumerate(groups):
                    if skip is None or not skip.covers(first_row, first_row + n):
                        group_row = first_row
                        for batch in self._read_row_group(pf, i, columns):
                            yield from _batch_rows(batch, group_row, skip, self.batch_rows)
                            group_row += batch.num_rows
                    first_row += n

    def _read_row_group(self, pf: pq.ParquetFile, index: int, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
        # The only place row data is read; tests count calls here.
        return pf.iter_batches(batch_size=self.batch_rows, row_groups=[index], columns=columns)


class DatasetsSource(Source):
    """A folder written by `datasets.Dataset.save_to_disk`: its data-*.arrow shards are Arrow IPC
    streams, read here with pyarrow through a memory map (no `datasets` import)."""

    format_name = "datasets"
    batch_rows: int = 1024

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        if (path / "dataset_dict.json").exists():
            _detect(path)  # raises with the split list
        self.files = self._shards()
        self._file_rows: list[int] = []
        for file in self.files:
            with self._open(file) as reader:
                if file is self.files[0]:
                    self.columns = reader.schema.names
                self._file_rows.append(sum(batch.num_rows for batch in self._batches(reader)))
        self.num_rows = sum(self._file_rows)

    def unit_starts(self) -> list[int]:
        starts, row = [], 0
        for n in self._file_rows:
            starts.append(row)
            row += n
        return starts or [0]

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        first_row = 0
        for file, file_rows in zip(self.files, self._file_rows):
            if skip is not None and skip.covers(first_row, first_row + file_rows):
                first_row += file_rows
                continue
            with self._open(file) as reader:
                for batch in self._batches(reader):
                    if columns is not None:
                        batch = batch.select([c for c in columns if c in batch.schema.names])
                    yield from _batch_rows(batch, first_row, skip, self.batch_rows)
                    first_row += batch.num_rows

    def _shards(self) -> list[Path]:
        state = self.path / "state.json"
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except FileNotFoundError:
            names = sorted(p.name for p in self.path.glob("data-*.arrow"))
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"{state} is not a datasets state file ({e}); re-save the dataset with save_to_disk") from e
        files = [self.path / name for name in names]
        if not files or not all(f.exists() for f in files):
            raise SourceError(f"{self.path} lacks its data-*.arrow files; re-save the dataset with save_to_disk")
        return files

    @contextmanager
    def _open(self, file: Path) -> Iterator[pa.ipc.RecordBatchStreamReader | pa.ipc.RecordBatchFileReader]:
        with pa.memory_map(str(file)) as source:
            try:
                is_file_format = source.read(6) == b"ARROW1"  # datasets itself writes IPC streams
                source.seek(0)
                reader = pa.ipc.open_file(source) if is_file_format else pa.ipc.open_stream(source)
            except pa.ArrowInvalid as e:
                raise SourceError(f"cannot read {file} as Arrow: {e}") from e
            yield reader

    @staticmethod
    def _batches(reader) -> Iterator[pa.RecordBatch]:
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)
