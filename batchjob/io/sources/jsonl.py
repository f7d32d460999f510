"""JSON Lines sources: a plain file or a folder of them read as one seekable stream (`JsonlSource`),
and gzip / zstd files or folders decompressed as read (`CompressedJsonlSource`).

A plain source resumes (or starts a shard) by seeking to a byte offset; a compressed one cannot seek,
so a resume reads past the committed rows, splitting lines without parsing them.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import ClassVar

import pyarrow as pa

from batchjob.io.ranges import RowRanges
from batchjob.io.sources.base import InputRow, Source, SourceError, folder_files, narrow
from batchjob.io.sources.pipes import is_pipe, open_input

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
FOLDER_JSONL_SUFFIXES = (".jsonl", ".ndjson")  # not .json: folders often hold metadata .json files
CODECS = {".gz": "gzip", ".zst": "zstd"}  # by file suffix
JSONL_CODECS = {"jsonl": None, "jsonl.gz": "gzip", "jsonl.zst": "zstd"}  # by input_format


def codec_of(path: Path) -> str | None:
    return CODECS.get(path.suffix.lower())


def is_jsonl_name(name: str, suffixes: tuple[str, ...]) -> bool:
    """Whether the file name ends in one of `suffixes`, once a compression suffix is taken off."""
    name = name.lower()
    for ext in CODECS:
        name = name.removesuffix(ext)
    return name.endswith(suffixes)


def open_jsonl(path: Path, codec: str | None) -> Source:
    """A file: plain, or compressed (by `codec`, else by its suffix). A folder: its JSONL files, plain
    ones read as one seekable file; any compressed one makes the folder a compressed source."""
    if path.is_dir():
        files = folder_files(path, lambda p: is_jsonl_name(p.name, FOLDER_JSONL_SUFFIXES), "JSON Lines")
        if not files:
            raise SourceError(f"{path} holds no JSON Lines files (*.jsonl, *.ndjson, or those with .gz / .zst)")
        if any(codec_of(f) for f in files):
            return CompressedJsonlSource(path, files)
        return JsonlSource(path, files)
    codec = codec or codec_of(path)
    return CompressedJsonlSource(path, codec=codec) if codec else JsonlSource(path)


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
        return open_input(file)

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
        return InputRow(row_index, narrow(value, columns))

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
            shape = "looks like a JSON array" if first.startswith(b"[") else "does not look like JSON Lines"
            raise SourceError(f"{self.path} {shape}: none of its first {seen} lines is a JSON object; "
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
        super().__init__(path, files)
        self.num_bytes = total  # of all its files: what byte offsets count up to (progress by bytes read)

    @property
    def seeks(self) -> bool:
        return True

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
        kinds = {codec or codec_of(f) for f in files or [path]} - {None}
        self.format_name = f"JSONL ({kinds.pop()})" if len(kinds) == 1 else "JSONL (compressed)"
        super().__init__(path, files or [path])

    def _open(self, file: Path):
        codec = self.codec or codec_of(file)
        if codec == "gzip":
            return gzip.GzipFile(fileobj=open_input(file), mode="rb") if is_pipe(file) else gzip.open(file, "rb")
        if codec == "zstd":
            return pa.input_stream(open_input(file) if is_pipe(file) else str(file), compression="zstd")
        return open_input(file)

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
                              f"{self.codec or codec_of(file) or 'file'}); replace the file and rerun") from e

