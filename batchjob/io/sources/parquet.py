"""Parquet sources: a .parquet file or a folder of them (`ParquetSource`), and a hive-partitioned folder
of key=value subfolders (`ParquetDatasetSource`); both read one row group at a time, and a resume or
a shard never opens a file or reads a row group it skips whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.io.ranges import RowRanges
from batchjob.io.sources.base import InputRow, Source, SourceError, folder_files, is_hidden, record_batch_rows


def is_hive_folder(path: Path) -> bool:
    """A folder with key=value subfolders (a hive-partitioned dataset)."""
    return path.is_dir() and any(p.is_dir() and "=" in p.name and not is_hidden(p.name) for p in path.iterdir())


class ParquetSource(Source):
    """A .parquet file or a folder of them (sorted by name), read one row group at a time."""

    format_name = "Parquet"
    batch_rows: int = 1024  # rows converted to Python at once

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        if path.is_dir():
            self.files = folder_files(path, lambda p: p.suffix.lower() == ".parquet", "Parquet")
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
            yield from record_batch_rows(batch, row, skip, batch_rows)
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
        self.files = folder_files(path, lambda p: p.suffix.lower() == ".parquet", "Parquet", recursive=True)
        if not self.files:
            raise SourceError(f"{path} holds no *.parquet files in its key=value subfolders")
        import pyarrow.dataset as pa_ds  # here: it imports pandas (0.7 s), which every other run of `batchjob` skips

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

