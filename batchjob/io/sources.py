"""Input sources: stream the rows of JSON Lines (a file, gzip/zstd-compressed, or a folder of them),
CSV/TSV, Parquet (a file, a folder, a hive-partitioned dataset) or a `datasets` save_to_disk folder.

Each source yields `InputRow`s in input order with a 0-based `row_index`, reads ahead a bounded
amount (one chunk / one record batch), and does not read rows a resume asks it to skip where the
format allows (whole Parquet row groups and files; a plain JSONL byte offset). Compressed JSONL and
CSV cannot seek: a resume reads past the committed rows without converting them.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.dataset as pa_ds
import pyarrow.parquet as pq

from batchjob.io.ranges import RowRanges

log = logging.getLogger(__name__)

FORMATS = {"jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "jsonl.gz": "jsonl.gz", "jsonl.zst": "jsonl.zst",
           "csv": "csv", "tsv": "tsv", "parquet": "parquet", "datasets": "datasets", "openai-batch": "openai-batch"}
SUPPORTED = ("JSON Lines (.jsonl/.json/.ndjson, gzip .jsonl.gz or zstd .jsonl.zst, or a folder of them), "
             "CSV (.csv), TSV (.tsv), Parquet (.parquet file, a folder of them, or a hive-partitioned folder "
             "of key=value subfolders), a `datasets` save_to_disk folder")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
FOLDER_JSONL_SUFFIXES = (".jsonl", ".ndjson")  # not .json: folders often hold metadata .json files
CODECS = {".gz": "gzip", ".zst": "zstd"}  # by file suffix
JSONL_CODECS = {"jsonl": None, "jsonl.gz": "gzip", "jsonl.zst": "zstd"}  # by input_format
CSV_DELIMITERS = {"csv": ",", "tsv": "\t"}


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
        self.files: list[Path] = [path]  # the data files read, in reading order (the job fingerprint hashes them)
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
    inner = getattr(source, "inner", source)  # a shard's columns are its input's
    hint = f" (taken from the first {inner.sample_lines} lines)" if isinstance(inner, JsonLines) else ""
    raise SourceError(f"{what} not found in {source.path}; available columns{hint}: {available}")


# ---- choosing a source -----------------------------------------------------------------------------


def open_source(path: str | Path, *, input_format: str | None = None) -> Source:
    path = Path(path)
    if not path.exists():
        raise SourceError(f"input not found: {path} (check the input path in the job file)")
    kind = _detect(path) if input_format is None else FORMATS.get(input_format.lower())
    if kind is None:
        raise SourceError(f"unknown input_format {input_format!r}; use one of: {', '.join(sorted(FORMATS))}")
    try:
        if kind == "jsonl" and input_format is None and path.is_file() and _codec_of(path) is None \
                and _first_line_is_openai_batch(path):
            kind = "openai-batch"
        if kind == "openai-batch":
            if path.is_dir() or _codec_of(path) is not None:
                raise SourceError(f"{path}: an OpenAI Batch input must be one uncompressed .jsonl file")
            from batchjob.io.openai_batch import OpenAIBatchSource  # it builds on JsonlSource

            return OpenAIBatchSource(path)
        if kind in JSONL_CODECS:
            return _jsonl_source(path, JSONL_CODECS[kind])
        if kind in CSV_DELIMITERS:
            return CsvSource(path, CSV_DELIMITERS[kind])
        if kind == "parquet":
            return ParquetDatasetSource(path) if _is_hive_folder(path) else ParquetSource(path)
        return DatasetsSource(path)
    except PermissionError as e:
        raise SourceError(f"cannot read {path}: permission denied ({e.filename})") from e


def _jsonl_source(path: Path, codec: str | None) -> Source:
    """A file: plain, or compressed (by `codec`, else by its suffix). A folder: its JSONL files, plain
    ones read as one seekable file; any compressed one makes the folder a compressed source."""
    if path.is_dir():
        files = _folder_files(path, lambda p: _jsonl_name(p.name, FOLDER_JSONL_SUFFIXES), "JSON Lines")
        if not files:
            raise SourceError(f"{path} holds no JSON Lines files (*.jsonl, *.ndjson, or those with .gz / .zst)")
        if any(_codec_of(f) for f in files):
            return CompressedJsonlSource(path, files)
        return JsonlSource(path, files)
    codec = codec or _codec_of(path)
    return CompressedJsonlSource(path, codec=codec) if codec else JsonlSource(path)


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
        names = [p.name for p in path.iterdir() if p.is_file() and not _hidden(p.name)]
        if _is_hive_folder(path) or any(n.lower().endswith(".parquet") for n in names):
            return "parquet"
        if any(_jsonl_name(n, FOLDER_JSONL_SUFFIXES) for n in names):
            return "jsonl"
        raise SourceError(f"{path} is a folder with no *.parquet or *.jsonl files, no key=value subfolders and "
                          f"no datasets state.json; supported: {SUPPORTED}")
    name = path.name.lower()
    if _jsonl_name(name, JSONL_SUFFIXES):
        return {codec: kind for kind, codec in JSONL_CODECS.items()}[_codec_of(path)]
    for kind in CSV_DELIMITERS:
        if name.endswith("." + kind):
            return kind
    if path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    raise SourceError(f"cannot tell the format of {path} from its name; supported: {SUPPORTED}; "
                      f"or set input_format to one of: {', '.join(sorted(set(FORMATS.values())))}")


def _dataset_dict_splits(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p.name for p in path.iterdir() if (p / "state.json").exists())


def _codec_of(path: Path) -> str | None:
    return CODECS.get(path.suffix.lower())


def _jsonl_name(name: str, suffixes: tuple[str, ...]) -> bool:
    name = name.lower()
    for ext in CODECS:
        name = name.removesuffix(ext)
    return name.endswith(suffixes)


def _hidden(name: str) -> bool:
    # pyarrow's and Spark's rule: _SUCCESS, _metadata, .crc files and the like are not data
    return name.startswith((".", "_"))


def _is_hive_folder(path: Path) -> bool:
    return path.is_dir() and any(p.is_dir() and "=" in p.name and not _hidden(p.name) for p in path.iterdir())


def _folder_files(folder: Path, is_member: Callable[[Path], bool], what: str, *, recursive: bool = False) -> list[Path]:
    """The files of `folder` that are members, in path order. Everything else (hidden names aside)
    is named in one warning, so a file left out by its name does not go unnoticed."""
    members, skipped = [], []
    if recursive:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            for name in files:
                if not _hidden(name):
                    file = Path(root) / name
                    (members if is_member(file) else skipped).append(file)
    else:
        for entry in folder.iterdir():
            if _hidden(entry.name):
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


# ---- JSON Lines ----------------------------------------------------------------------------------------


class JsonLines(Source):
    """What every JSON Lines source shares: splitting a byte stream into lines with a bounded buffer,
    parsing a line into a row (a bad one into a row error naming its file and line), and learning the
    columns from the first lines. A blank line is not a row: row_index counts non-blank lines."""

    format_name = "JSONL"
    sample_lines: ClassVar[int] = 100  # lines read up front to learn the columns
    chunk_bytes: int = 1 << 20  # read-ahead; the buffer holds one chunk plus one partial line

    def __init__(self, path: Path, files: list[Path]) -> None:
        super().__init__(path)
        self.files = files
        self.peak_buffer_bytes = 0  # largest read-ahead held so far (tests pin the bound)
        self.columns = self._sample_columns()

    def _open(self, file: Path):
        return open(file, "rb")

    def _reading(self, file: Path, line_no: Callable[[], int | None] = lambda: None):
        """Around each read of `file`: where a source turns a damaged stream into a SourceError."""
        return nullcontext()

    def _name(self, file: Path) -> str:
        return file.relative_to(self.path).as_posix() if self.path.is_dir() else file.name

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

    def _sample_columns(self) -> list[str]:
        columns: dict[str, None] = {}
        seen, objects, first = 0, 0, b""
        for file in self.files:
            with self._reading(file), self._open(file) as f:
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
            if seen >= self.sample_lines:
                break
        if seen and not objects:
            shape = "a JSON array" if first.startswith(b"[") else "not JSON Lines"
            raise SourceError(f"{self.path} looks like {shape}: none of its first {seen} lines is a JSON object; "
                              "write one JSON object per line (JSON Lines)")
        self.peak_buffer_bytes = 0
        return list(columns)


class JsonlSource(JsonLines):
    """One JSON object per line: a file, or a folder of plain JSONL files read as their concatenation in
    name order, so byte offsets count across the files and a resume or a shard seeks to any row."""

    def __init__(self, path: Path, files: list[Path] | None = None) -> None:
        if files is None:
            if path.is_dir():
                raise SourceError(f"{path} is a folder; JSONL input must be a file (or open the folder with open_source)")
            files = [path]
        self._position = (0, 0)
        self._bases: list[int] = []  # byte offset where each file begins in the concatenation
        total = 0
        for file in files:
            self._bases.append(total)
            total += file.stat().st_size
        self.num_bytes = total  # of all its files: what byte offsets count up to (progress by bytes read)
        super().__init__(path, files)

    def position(self) -> tuple[int, int]:
        """(next row_index, byte offset just past the last yielded row): pass it back as
        `start_offset` to resume there. Valid after each row the current `rows()` yielded."""
        return self._position

    def row_ends(self) -> Iterator[int]:
        """The byte offset just past each row's line, in row order, without parsing a line: row r
        starts at (r, ends[r - 1]) (shard planning)."""
        for file, base in zip(self.files, self._bases):
            with self._open(file) as f:
                for line, _, end in self._lines(f, 0):
                    if line.strip():
                        yield base + end

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None,
             start_offset: tuple[int, int] | None = None) -> Iterator[InputRow]:
        row_index, offset = start_offset or (0, 0)
        self._position = (row_index, offset)
        if offset > self.num_bytes:
            self._refuse_offset(offset)
        for i, (file, base) in enumerate(zip(self.files, self._bases)):
            end_of_file = self._bases[i + 1] if i + 1 < len(self.files) else None
            if end_of_file is not None and offset >= end_of_file:
                continue  # the resume point is in a later file
            local = max(offset - base, 0)
            name = self._name(file)
            with self._open(file) as f:
                if local:
                    self._check_line_start(f, local)
                f.seek(local)
                line_no = 1 if local == 0 else None  # unknown after a seek: errors then cite the byte
                for line, start, end in self._lines(f, local):
                    if line.strip():
                        if skip is None or row_index not in skip:
                            where = f"{name} line {line_no}" if line_no else f"{name} byte {start}"
                            row = self._parse(row_index, line, where, columns)
                            self._position = (row_index + 1, base + end)
                            yield row
                        else:
                            self._position = (row_index + 1, base + end)
                        row_index += 1
                    if line_no:
                        line_no += 1

    def _check_line_start(self, f, offset: int) -> None:
        f.seek(offset - 1)
        if f.read(1) != b"\n":
            self._refuse_offset(offset)

    def _refuse_offset(self, offset: int) -> None:
        raise SourceError(f"resume offset {offset} is not at a line start in {self.path}; "
                          "the input file changed since the run started — rerun into a new output folder")


class CompressedJsonlSource(JsonLines):
    """gzip or zstd JSON Lines — a file, or a folder holding such files (its plain files are read as
    they are) — decompressed as it is read. A compressed stream cannot seek, so there is no byte
    offset to resume at: a resume reads past the committed rows (splitting lines, not parsing them).
    The row count is known once a read reaches the end."""

    def __init__(self, path: Path, files: list[Path] | None = None, *, codec: str | None = None) -> None:
        self.codec = codec  # None: each file's by its suffix
        kinds = {codec or _codec_of(f) for f in files or [path]} - {None}
        self.format_name = f"JSONL ({kinds.pop()})" if len(kinds) == 1 else "JSONL (compressed)"
        super().__init__(path, files or [path])

    def _open(self, file: Path):
        codec = self.codec or _codec_of(file)
        if codec == "gzip":
            return gzip.open(file, "rb")
        if codec == "zstd":
            return pa.input_stream(str(file), compression="zstd")
        return open(file, "rb")

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        row_index = 0
        for file in self.files:
            name, line_no = self._name(file), 0
            with self._reading(file, lambda: line_no), self._open(file) as f:
                for line, _, _ in self._lines(f, 0):
                    line_no += 1
                    if line.strip():
                        if skip is None or row_index not in skip:
                            yield self._parse(row_index, line, f"{name} line {line_no}", columns)
                        row_index += 1
        self.num_rows = row_index

    @contextmanager
    def _reading(self, file: Path, line_no: Callable[[], int | None] = lambda: None) -> Iterator[None]:
        # A damaged stream is the job's problem, not a row's: nothing after the damage can be read.
        try:
            yield
        except PermissionError:
            raise
        except (OSError, EOFError, zlib.error) as e:
            at = f" after line {line_no()}" if line_no() else ""
            raise SourceError(f"cannot read {file}{at}: {e} (a damaged or truncated "
                              f"{self.codec or _codec_of(file) or 'file'}); replace the file and rerun") from e


# ---- CSV / TSV -------------------------------------------------------------------------------------------


class CsvSource(Source):
    """A CSV or TSV file with a header row, streamed by pyarrow's CSV reader one block at a time
    (quoted values may hold delimiters, quotes and newlines). Every value is text and an empty field
    is null: types guessed from the first block could not hold for a later one, which would fail
    the job midway. A record with the wrong number of fields, or with bytes that are not UTF-8, is a
    row error naming its record number (the header is record 1). The row count is known once a read
    reaches the end; a resume reads past the committed rows without converting them."""

    batch_rows: int = 1024  # rows converted to Python at once
    block_bytes: int = 16 << 20  # pyarrow's read block; one record must fit in it

    def __init__(self, path: Path, delimiter: str = ",") -> None:
        super().__init__(path)
        if path.is_dir():
            raise SourceError(f"{path} is a folder; CSV/TSV input must be a file")
        self.delimiter = delimiter
        self.format_name = "TSV" if delimiter == "\t" else "CSV"
        with self._reader(lambda record: "skip") as reader:  # bad records are the rows' problem, later
            self.columns = reader.schema.names
        repeated = sorted({c for c in self.columns if self.columns.count(c) > 1})
        if repeated:
            raise SourceError(f"{path}: the header names {', '.join(map(repr, repeated))} more than once; "
                              "every column needs its own name")

    @contextmanager
    def _reader(self, on_bad_record: Callable) -> Iterator[pa_csv.CSVStreamingReader]:
        # use_threads=False: the parser then knows each bad record's number, which places its row error
        read = pa_csv.ReadOptions(block_size=self.block_bytes, use_threads=False)
        parse = pa_csv.ParseOptions(delimiter=self.delimiter, newlines_in_values=True, invalid_row_handler=on_bad_record)
        # only an empty field is null: pyarrow's default nulls ("NULL", "N/A", "nan", ...) are text a prompt may be
        convert = pa_csv.ConvertOptions(column_types=dict.fromkeys(self.columns, pa.string()), null_values=[""],
                                        strings_can_be_null=True, check_utf8=False)
        try:
            reader = pa_csv.open_csv(self.path, read_options=read, parse_options=parse, convert_options=convert)
        except pa.ArrowInvalid as e:
            raise SourceError(self._problem(e, 1)) from e
        try:
            yield reader
        finally:
            reader.close()

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        name = self.path.name
        set_aside: deque[tuple[int, str]] = deque()  # (row_index, error) of bad records, in order; may run ahead

        def bad_record(record) -> str:
            text = record.text if len(record.text) <= 80 else record.text[:77] + "..."
            set_aside.append((record.number - 2, f"{name} record {record.number}: expected {record.expected_columns} "
                                                 f"fields, got {record.actual_columns}: {text!r}"))
            return "skip"

        row = 0
        with self._reader(bad_record) as reader:
            for batch in self._batches(reader, lambda: row):
                # the batch's rows take the next row indices that no set-aside record holds
                end = row + batch.num_rows
                for index, _ in set_aside:
                    if index >= end:
                        break
                    end += 1
                if skip is not None and skip.covers(row, end):
                    while set_aside and set_aside[0][0] < end:
                        set_aside.popleft()
                    row = end
                    continue
                for offset in range(0, batch.num_rows, self.batch_rows):
                    for record in self._records(batch.slice(offset, self.batch_rows)):
                        while set_aside and set_aside[0][0] == row:
                            error = set_aside.popleft()[1]
                            if skip is None or row not in skip:
                                yield InputRow(row, None, error)
                            row += 1
                        if skip is None or row not in skip:
                            if isinstance(record, UnicodeDecodeError):
                                yield InputRow(row, None, f"{name} record {row + 2}: not UTF-8 text: {record}")
                            else:
                                yield InputRow(row, _narrow(record, columns))
                        row += 1
        for index, error in set_aside:  # bad records after the last good one
            if skip is None or index not in skip:
                yield InputRow(index, None, error)
            row = index + 1
        self.num_rows = row

    def _batches(self, reader: pa_csv.CSVStreamingReader, row: Callable[[], int]) -> Iterator[pa.RecordBatch]:
        while True:
            try:
                yield reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as e:
                raise SourceError(self._problem(e, row() + 1)) from e

    @staticmethod
    def _records(piece: pa.RecordBatch) -> list[dict | UnicodeDecodeError]:
        """The rows as dicts; a row holding bytes that are not UTF-8 as its decoding error instead."""
        try:
            return piece.to_pylist()
        except UnicodeDecodeError:
            records: list[dict | UnicodeDecodeError] = []
            for i in range(piece.num_rows):
                try:
                    records.append(piece.slice(i, 1).to_pylist()[0])
                except UnicodeDecodeError as e:
                    records.append(e)
            return records

    def _problem(self, e: Exception, record: int) -> str:
        text = str(e)
        if "Empty CSV file" in text:
            return f"{self.path} is empty; a {self.format_name} input needs a header row"
        if "straddl" in text:
            return (f"{self.path}: a record after record {record} is longer than the {self.block_bytes >> 20} MiB "
                    f"read block (or a quote is not closed); check the quoting there")
        return f"cannot read {self.path} as {self.format_name} (after record {record}): {text}"


# ---- Parquet and datasets ------------------------------------------------------------------------------


class ParquetSource(Source):
    """A .parquet file or a folder of them (sorted by name), read one row group at a time."""

    format_name = "Parquet"
    batch_rows: int = 1024  # rows converted to Python at once

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        if path.is_dir():
            self.files = _folder_files(path, lambda p: p.suffix.lower() == ".parquet", "Parquet")
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
        return _group_starts(self._row_groups)

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
                        yield from _row_group_rows(lambda i=i: self._read_row_group(pf, i, columns), file, i,
                                                   first_row, n, skip, self.batch_rows)
                    first_row += n

    def _read_row_group(self, pf: pq.ParquetFile, index: int, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
        # The only place row data is read; tests count calls here.
        return pf.iter_batches(batch_size=self.batch_rows, row_groups=[index], columns=columns)


def _row_group_rows(read, file: Path, index: int, first_row: int, n: int, skip: RowRanges | None,
                    batch_rows: int) -> Iterator[InputRow]:
    """The rows of one row group; when its data cannot be read (a corrupt page), each row not yet given
    becomes a row error naming the file and row group, and the job goes on with the next group."""
    row = first_row
    try:
        for batch in read():
            yield from _batch_rows(batch, row, skip, batch_rows)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, PermissionError):
            raise
        why = f"{file}: row group {index} (rows {first_row}-{first_row + n - 1}) cannot be read: {e}"
        for r in range(row, first_row + n):
            if skip is None or r not in skip:
                yield InputRow(r, None, error=why)


def _group_starts(row_groups: list[list[int]]) -> list[int]:
    starts, row = [], 0
    for groups in row_groups:
        for n in groups:
            starts.append(row)
            row += n
    return starts or [0]


class ParquetDatasetSource(Source):
    """A hive-partitioned Parquet folder (`year=2024/lang=en/part-0.parquet`), read with pyarrow.dataset:
    each key=value folder level is a column (typed as pyarrow infers it from the values), the files
    are read in path order, one row group at a time, and a resume skips whole files and row groups."""

    format_name = "Parquet dataset"
    batch_rows: int = 1024

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.files = _folder_files(path, lambda p: p.suffix.lower() == ".parquet", "Parquet", recursive=True)
        if not self.files:
            raise SourceError(f"{path} holds no *.parquet files in its key=value subfolders")
        try:
            self._dataset = pa_ds.dataset([str(f) for f in self.files], format="parquet",
                                          partitioning=pa_ds.HivePartitioning.discover(), partition_base_dir=str(path))
            self._fragments = list(self._dataset.get_fragments())
            self._row_groups = [[group.num_rows for group in fragment.row_groups] for fragment in self._fragments]
        except PermissionError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"cannot read {path} as a hive-partitioned Parquet dataset: {e}") from e
        first = self._fragments[0].physical_schema.names
        for file, fragment in zip(self.files, self._fragments):
            names = fragment.physical_schema.names
            if names != first:
                raise SourceError(f"{file} has columns {', '.join(names)} but {self.files[0].relative_to(path)} has "
                                  f"{', '.join(first)}; all files of a Parquet dataset need the same columns")
        self.columns = self._dataset.schema.names  # the files' columns, then the partition keys
        self.num_rows = sum(sum(groups) for groups in self._row_groups)

    def unit_starts(self) -> list[int]:
        return _group_starts(self._row_groups)

    def rows(self, skip: RowRanges | None = None, *, columns: list[str] | None = None) -> Iterator[InputRow]:
        wanted = self.columns if columns is None else [c for c in columns if c in self.columns]
        first_row = 0
        for fragment, groups in zip(self._fragments, self._row_groups):
            for i, n in enumerate(groups):
                if skip is None or not skip.covers(first_row, first_row + n):
                    # the dataset's schema fills the partition columns from the fragment's folder names
                    yield from _row_group_rows(
                        lambda fragment=fragment, i=i: fragment.subset(row_group_ids=[i]).to_batches(
                            schema=self._dataset.schema, columns=wanted, batch_size=self.batch_rows),
                        Path(fragment.path), i, first_row, n, skip, self.batch_rows)
                first_row += n


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
