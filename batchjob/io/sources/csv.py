"""CSV and TSV sources: a file with a header row, streamed by pyarrow's CSV reader one block at a time;
a record with the wrong number of fields, or not UTF-8, is a row error naming its record number."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv

from batchjob.io.ranges import RowRanges
from batchjob.io.sources.base import InputRow, Source, SourceError, narrow

CSV_DELIMITERS = {"csv": ",", "tsv": "\t"}  # by input_format


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
                                yield InputRow(row, narrow(record, columns))
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
