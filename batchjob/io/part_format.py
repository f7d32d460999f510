"""How part files are written (`--part-format`): a plain enum, so that naming it imports no pyarrow."""
from __future__ import annotations

from enum import StrEnum


class PartFormat(StrEnum):
    ARROW = "arrow"  # Arrow IPC files
    PARQUET = "parquet"  # Parquet, zstd
