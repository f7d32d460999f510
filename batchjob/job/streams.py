"""A job's streams: each input (found and checked in inputs.py) with its output folder and sink, and the rows of
a stream that are not committed yet (where a resume starts reading)."""
from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from batchjob.job.options.config import JobConfig
from batchjob.job.options.fingerprint import ModelFacts, fingerprint
from batchjob.job.inputs import OpenedInput
from batchjob.io.disk import disk
from batchjob.io.export import ERRORS_FILE, RESULTS_FILE
from batchjob.io.manifest import MANIFEST, Manifest, ManifestError
from batchjob.io.parts import part_schema
from batchjob.io.recovery import clear_results
from batchjob.io.sink import INPUT_PATH, RESUME_POSITION, ArrowSink
from batchjob.io.sources import InputRow, OpenAIBatchSource, Source
from batchjob.job.rows.results import OutputColumns, output_columns

@dataclass(slots=True, eq=False)
class Stream:
    """One input and its output folder. `lane` is fixed for per-lane inputs, else chosen per row."""
    source: Source
    sink: ArrowSink
    lane: str | None
    key_salt: int = 0
    rows: Iterator[InputRow] | None = None
    exhausted: bool = False
    columns: OutputColumns = OutputColumns()  # the optional output columns: kept input columns, logprobs, completions


def open_streams(cfg: JobConfig, sources: list[OpenedInput], model: ModelFacts, lane_column_out: bool) -> list[Stream]:
    """A sink per input, under the job's fingerprint, with the output columns its rows will have."""
    defaults = cfg.sampling_defaults()
    streams = []
    for source, path, folder, lane in sources:
        keep = [*id_columns(cfg, source, folder), *cfg.keep_columns] + (["lane"] if lane_column_out else [])
        keep = list(dict.fromkeys(keep))  # the id once, first
        columns = output_columns(keep, defaults, source.columns, source.format_name == OpenAIBatchSource.format_name,
                                 reasoning=cfg.reasoning_parser is not None, tools=cfg.tool_parser is not None)
        sink = ArrowSink(folder, fingerprint=fingerprint(cfg, source, path, model), keep_columns=columns.names,
                         part_rows=cfg.part_rows, part_seconds=cfg.part_seconds, total_rows=source.num_rows,
                         part_format=cfg.part_format, column_types=columns.types)
        sink.set_extra(INPUT_PATH, str(Path(path).resolve()))  # `show` reads prompts from it, by row index
        streams.append(Stream(source, sink, lane, key_salt=zlib.crc32(lane.encode()) if lane else 0, columns=columns))
    return streams


ID_COLUMNS = ("id", "custom_id")  # an input's id-like columns, kept in the output by default


def id_columns(cfg: JobConfig, source: Source, folder: Path) -> list[str]:
    """The id column copied into the output: --id-column, else the input's `id` or `custom_id`. A folder
    with parts from before ids were kept stays as it is (every part of a folder has the same columns)."""
    if cfg.id_column == "none":
        return []
    if cfg.id_column is not None:
        return [cfg.id_column]
    found = next((c for c in ID_COLUMNS if c in source.columns), None)
    if found is None:
        return []
    try:
        manifest = Manifest.load(folder) if (folder / MANIFEST).exists() else None
    except ManifestError:
        return [found]  # the sink repairs or refuses the folder, and says why
    if manifest is not None and manifest.parts and found not in {f.name for f in part_schema(folder / manifest.parts[-1].name)}:
        return []
    return [found]


def clear_for_restart(out: Path, folders: list[Path]) -> None:
    """--restart: delete the committed results (parts, manifests, stats) and start over."""
    removed = 0
    for folder in {out, *folders}:
        removed += clear_results(folder)
        for name in ("stats.jsonl", RESULTS_FILE, ERRORS_FILE):
            if (folder / name).is_file():
                disk().unlink(folder / name)
                removed += 1
        disk().fsync_dir(folder)
    print(f"batchjob: --restart: removed {removed} result files from {out}", file=sys.stderr)


def remove_bare_folders(folders: list[Path]) -> None:
    """Take back folders that hold nothing but the output lock (a job that failed before committing)."""
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # innermost first
        try:
            lock = folder / ".lock"
            if lock.is_file() and {p.name for p in folder.iterdir()} == {".lock"}:
                disk().unlink(lock)
            folder.rmdir()  # only when empty
        except OSError:
            pass


def uncommitted_rows(stream: Stream, limit: int | None) -> Iterator[InputRow]:
    """The rows not committed yet. JSONL resumes at the byte offset of the first row not committed
    (the committed prefix is never read) and notes each row's offset for the next resume; Parquet
    and datasets inputs skip whole row groups / files instead."""
    for item in _rows_from(stream):
        if limit is not None and item.row_index >= limit:  # rows come in input order: the rest waits for a rerun
            return
        yield item


def _rows_from(stream: Stream) -> Iterator[InputRow]:
    source, sink = stream.source, stream.sink
    if not source.seeks:
        unknown = source.num_rows is None  # a streamed input (CSV, compressed JSONL) counts its rows as it reads
        yield from source.rows(skip=sink.done)
        if unknown and source.whole.num_rows is not None:
            sink.set_total_rows(source.whole.num_rows)  # now known: `status` and `export` can tell what is missing
        return
    start = tuple(source.position())  # (0, 0), or where a shard begins
    resume = sink.extra.get(RESUME_POSITION)
    # valid only while every row before it is committed (a damaged part's rows must be read again)
    if resume and resume[0] > start[0] and sink.done.covers(start[0], resume[0]):
        start = (int(resume[0]), int(resume[1]))
    before = start
    for item in source.rows(skip=sink.done, start_offset=start):
        sink.note_position(item.row_index, list(before))
        yield item
        before = source.whole.position()  # a shard: its input's, current as soon as the row is yielded
    if source.num_rows is None:
        sink.set_total_rows(before[0])  # now known: `status` and `export` can tell what is missing
