"""Input sources: stream the rows of JSON Lines (a file, gzip/zstd-compressed, or a folder of them),
CSV/TSV, Parquet (a file, a folder, a hive-partitioned dataset), a `datasets` save_to_disk folder or an
OpenAI Batch request file; one module per format, `formats.py` chooses (`open_source`).

Each source yields `InputRow`s in input order with a 0-based `row_index`, reads ahead a bounded
amount (one chunk / one record batch), and does not read rows a resume asks it to skip where the
format allows (whole Parquet row groups and files; a plain JSONL byte offset). Compressed JSONL and
CSV cannot seek: a resume reads past the committed rows without converting them.
"""

from batchjob.io.sources.base import InputRow, Source, SourceError
from batchjob.io.sources.csv import CsvSource
from batchjob.io.sources.datasets import DatasetsSource
from batchjob.io.sources.formats import FORMATS, SUPPORTED, open_source, validate_columns
from batchjob.io.sources.jsonl import CompressedJsonlSource, JsonLines, JsonlSource
from batchjob.io.sources.openai_batch import OpenAIBatchSource
from batchjob.io.sources.parquet import ParquetDatasetSource, ParquetSource

__all__ = ["InputRow", "Source", "SourceError", "open_source", "validate_columns", "FORMATS", "SUPPORTED",
           "JsonLines", "JsonlSource", "CompressedJsonlSource", "CsvSource", "ParquetSource", "ParquetDatasetSource",
           "DatasetsSource", "OpenAIBatchSource"]
