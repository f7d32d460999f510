"""The `datasets` source: a folder written by `datasets.Dataset.save_to_disk`, its data-*.arrow shards
read with pyarrow (no `datasets` import); a DatasetDict folder is refused with the splits to choose from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from batchjob.io.ranges import RowRanges
from batchjob.io.sources.base import InputRow, Source, SourceError, record_batch_rows


def refuse_dataset_dict(path: Path) -> None:
    """A DatasetDict folder holds one dataset per split: raise, naming the splits and one to point at."""
    if (path / "dataset_dict.json").exists():
        splits = _dataset_dict_splits(path)
        raise SourceError(
            f"{path} is a DatasetDict with splits {', '.join(splits)}; "
            f"point the input at one split, e.g. {path / splits[0] if splits else path / 'train'}")


def _dataset_dict_splits(path: Path) -> list[str]:
    try:
        return list(json.loads((path / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(p.name for p in path.iterdir() if (p / "state.json").exists())


class DatasetsSource(Source):
    """A folder written by `datasets.Dataset.save_to_disk`: its data-*.arrow shards are Arrow IPC
    streams, read here with pyarrow through a memory map (no `datasets` import)."""

    format_name = "datasets"
    batch_rows: int = 1024

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        refuse_dataset_dict(path)
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
                    yield from record_batch_rows(batch, first_row, skip, self.batch_rows)
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
