"""Which source reads an input: the format table (`input_format`, or detected from the path's name, its
folder's contents or a JSONL file's first lines), `open_source`, and checking a job's columns against it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from batchjob.io.sources.base import Source, SourceError, is_hidden
from batchjob.io.sources.csv import CSV_DELIMITERS, CsvSource
from batchjob.io.sources.datasets import DatasetsSource, refuse_dataset_dict
from batchjob.io.sources.jsonl import (FOLDER_JSONL_SUFFIXES, JSONL_CODECS, JSONL_SUFFIXES, JsonLines, codec_of,
                                       is_jsonl_name, open_jsonl)
from batchjob.io.sources.openai_batch import is_openai_batch_file, open_openai_batch
from batchjob.io.sources.parquet import ParquetDatasetSource, ParquetSource, is_hive_folder

FORMATS = {"jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "jsonl.gz": "jsonl.gz", "jsonl.zst": "jsonl.zst",
           "csv": "csv", "tsv": "tsv", "parquet": "parquet", "datasets": "datasets", "openai-batch": "openai-batch"}
SUPPORTED = ("JSON Lines (.jsonl/.json/.ndjson, gzip .jsonl.gz or zstd .jsonl.zst, or a folder of them), "
             "CSV (.csv), TSV (.tsv), Parquet (.parquet file, a folder of them, or a hive-partitioned folder "
             "of key=value subfolders), a `datasets` save_to_disk folder")

# format (a value of FORMATS) -> how a path of that format opens
OPENERS: dict[str, Callable[[Path], Source]] = {
    "jsonl": lambda path: open_jsonl(path, JSONL_CODECS["jsonl"]),
    "jsonl.gz": lambda path: open_jsonl(path, JSONL_CODECS["jsonl.gz"]),
    "jsonl.zst": lambda path: open_jsonl(path, JSONL_CODECS["jsonl.zst"]),
    "csv": lambda path: CsvSource(path, CSV_DELIMITERS["csv"]),
    "tsv": lambda path: CsvSource(path, CSV_DELIMITERS["tsv"]),
    "parquet": lambda path: ParquetDatasetSource(path) if is_hive_folder(path) else ParquetSource(path),
    "datasets": DatasetsSource,
    "openai-batch": open_openai_batch,
}


def open_source(path: str | Path, *, input_format: str | None = None) -> Source:
    path = Path(path)
    if not path.exists():
        raise SourceError(f"input not found: {path} (check the input path in the job file)")
    kind = _detect(path) if input_format is None else FORMATS.get(input_format.lower())
    if kind is None:
        raise SourceError(f"unknown input_format {input_format!r}; use one of: {', '.join(sorted(FORMATS))}")
    try:
        if kind == "jsonl" and input_format is None and is_openai_batch_file(path):
            kind = "openai-batch"
        return OPENERS[kind](path)
    except PermissionError as e:
        raise SourceError(f"cannot read {path}: permission denied ({e.filename})") from e


def validate_columns(source: Source, required: list[str], fix: str = "") -> None:
    """SourceError when a required column is missing, naming the columns there are; `fix`: what to do, appended."""
    missing = [c for c in required if c not in source.columns]
    if not missing:
        return
    what = ("column " if len(missing) == 1 else "columns ") + ", ".join(repr(c) for c in missing)
    available = ", ".join(source.columns) or "(none)"
    inner = getattr(source, "inner", source)  # a shard's columns are its input's
    hint = f" (taken from the first {inner.sample_lines} lines)" if isinstance(inner, JsonLines) else ""
    raise SourceError(f"{what} not found in {source.path}; available columns{hint}: {available}" + (f"; {fix}" if fix else ""))


def _detect(path: Path) -> str:
    if path.is_dir():
        refuse_dataset_dict(path)
        if (path / "state.json").exists() or (path / "dataset_info.json").exists():
            return "datasets"
        names = [p.name for p in path.iterdir() if p.is_file() and not is_hidden(p.name)]
        if is_hive_folder(path) or any(n.lower().endswith(".parquet") for n in names):
            return "parquet"
        if any(is_jsonl_name(n, FOLDER_JSONL_SUFFIXES) for n in names):
            return "jsonl"
        raise SourceError(f"{path} is a folder with no *.parquet or *.jsonl files, no key=value subfolders and "
                          f"no datasets state.json; supported: {SUPPORTED}")
    name = path.name.lower()
    if is_jsonl_name(name, JSONL_SUFFIXES):
        return {codec: kind for kind, codec in JSONL_CODECS.items()}[codec_of(path)]
    for kind in CSV_DELIMITERS:
        if name.endswith("." + kind):
            return kind
    if path.suffix.lower() in (".parquet", ".pq"):
        return "parquet"
    raise SourceError(f"cannot tell the format of {path} from its name; supported: {SUPPORTED}; "
                      f"or set input_format to one of: {', '.join(sorted(set(FORMATS.values())))}")
