"""Export of one output folder: its committed rows as one file in input order (.parquet, .jsonl or
.arrow, merged by `merge.py`), or as an OpenAI Batch response file and its errors file."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from batchjob.io.disk import File, disk
from batchjob.io.manifest import Manifest, ManifestError, result_folders
from batchjob.io.merge import CHUNK_ROWS, FORMATS, ExportError, write_merged
from batchjob.io.openai_batch import response_lines
from batchjob.io.parts import read_results
from batchjob.io.ranges import RowRanges

RESULTS_FILE = "results.jsonl"  # an OpenAI Batch job's response file, in its output folder
ERRORS_FILE = "errors.jsonl"  # and its errors file, beside it
RESPONSE_FILES = (RESULTS_FILE, ERRORS_FILE)


def responses_written(out_dir: Path) -> bool:
    """Both response files are in the folder (each renamed into place whole; a crash can leave one or none)."""
    return all((out_dir / name).is_file() for name in RESPONSE_FILES)


@dataclass(slots=True)
class ExportSummary:
    rows: int
    missing: RowRanges  # rows of [0, total) left out (only with partial=True)
    total_rows: int | None
    path: Path
    note: str | None = None  # a line to show with the result: the job's last run had --limit N


def run_limit(manifest: Manifest) -> int | None:
    """The --limit N of the folder's last run (extra["run"]["limit"]), or None: a run without one, or a
    manifest from before the limit was recorded."""
    limit = (manifest.extra.get("run") or {}).get("limit")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1 else None


def _shard_start(manifest: Manifest) -> int:
    shard = manifest.fingerprint.get("shard")
    return shard.get("start", 0) if isinstance(shard, dict) else 0


def job_end(manifest: Manifest) -> int | None:
    """One past the last input row the folder should hold; None while that is unknown. The input's end
    (a shard's: start + its rows); for a --limit N run, N (rows past N committed by an earlier run count
    too), however far the input goes."""
    start = _shard_start(manifest)
    end = None if manifest.total_rows is None else start + manifest.total_rows
    limit = run_limit(manifest)
    if limit is not None:
        done = manifest.done_rows().ranges()
        limit = max(limit, done[-1][1]) if done else limit
        end = limit if end is None else min(end, limit)
    return end


def job_total(manifest: Manifest) -> int | None:
    """The number of rows the folder should hold (see job_end); None while unknown."""
    end = job_end(manifest)
    return None if end is None else max(0, end - _shard_start(manifest))


def export(out: str | Path, to: str | Path, *, partial: bool = False, chunk_rows: int = CHUNK_ROWS) -> ExportSummary:
    """Write every committed row of the output folder `out`, sorted by row_index, to `to`. Refuses
    when input rows are missing (naming them), unless `partial`."""
    out, to = Path(out), Path(to)
    kind = FORMATS.get(to.suffix.lower())
    if kind is None:
        raise ExportError(f"--to {to}: unknown format {to.suffix!r}; use a file name ending in .parquet, .jsonl or .arrow")
    folder = _one_folder(out)
    try:
        manifest = Manifest.load(folder)
    except ManifestError as e:
        raise ExportError(f"{e}; rerun the job on it (it repairs the manifest from manifest.json.prev) and export again") from e
    done = manifest.done_rows()
    total = job_total(manifest)
    missing = missing_rows(manifest) or RowRanges()
    limit = run_limit(manifest)
    note = None
    if limit is not None and total is not None and total != manifest.total_rows:
        start = _shard_start(manifest)
        note = (f"the job ran with --limit {limit:,}, so the export holds rows {start}-{start + total - 1} of the input "
                f"(its first {total:,}); rerun the job without --limit to continue with the rest")
    if not partial:
        if total is None:
            raise ExportError(f"{folder} holds {done.count()} rows, but the job has not read its input to the end, so "
                              "the number of input rows is unknown; rerun the job to finish it, or pass --partial")
        if missing:
            raise ExportError(f"{folder} lacks {missing.count()} of {total} rows: {missing.describe()}; rerun the job "
                              "to finish it, or pass --partial to export the committed rows only")
    rows = write_merged(folder, manifest.parts, to, kind, chunk_rows=chunk_rows)
    return ExportSummary(rows, missing, total, to, note)


def missing_rows(manifest: Manifest) -> RowRanges | None:
    """The input rows the folder should hold but does not; None while their number is unknown. A
    shard's folder holds its slice [start, end) of the input (recorded in its fingerprint); a --limit N
    run's folder, the rows below N (job_end)."""
    end = job_end(manifest)
    if end is None:
        return None
    start = _shard_start(manifest)
    return RowRanges((max(s, start), e) for s, e in manifest.done_rows().missing(end).ranges() if e > start)


def _one_folder(out: Path) -> Path:
    folders = result_folders(out) if out.is_dir() else []
    if not folders:
        raise ExportError(f"{out} has no manifest.json (nor a folder below it); it is not a batchjob output folder, or nothing ran yet")
    if len(folders) > 1:
        names = ", ".join(str(f.relative_to(out)) for f in folders)
        raise ExportError(f"{out} holds several result folders ({names}), each with its own input (per-lane inputs); "
                          f"export each one, e.g. batchjob export {folders[0]} --to FILE")
    return folders[0]


# OpenAI Batch response files


@dataclass(slots=True)
class ResponseFiles:
    path: Path  # a line per request that has a custom_id, answered or failed
    lines: int
    errors_path: Path  # a line per failed request, also those without a custom_id (OpenAI's error file)
    errors: int


def errors_file_for(to: str | Path) -> Path:
    """Where `export --format openai-batch --to FILE` puts the errors: FILE's name without .jsonl, plus
    .errors.jsonl, beside it (responses.jsonl -> responses.errors.jsonl)."""
    to = Path(to)
    return to.with_name(to.name.removesuffix(".jsonl") + ".errors.jsonl")


def write_openai_batch(out_dir: str | Path, *, created: int | None = None) -> ResponseFiles:
    """Write the committed rows of one output folder as OUTPUT/results.jsonl and OUTPUT/errors.jsonl."""
    out_dir = Path(out_dir)
    return write_responses([out_dir], out_dir / RESULTS_FILE, created, errors_to=out_dir / ERRORS_FILE)


def export_folder_responses(out: str | Path, to: str | Path, *, created: int | None = None) -> ResponseFiles:
    """`batchjob export OUT --format openai-batch --to FILE` for one output folder (the errors to
    `errors_file_for(FILE)`). Refuses when input rows are missing."""
    out = Path(out)
    manifest = Manifest.load(out)
    if manifest is None:
        raise ExportError(f"{out} has no manifest.json; it is not a batchjob output folder (or nothing ran yet)")
    done = manifest.num_rows()
    if manifest.total_rows is not None and done < manifest.total_rows:
        raise ExportError(f"{out} holds {done} of {manifest.total_rows} rows; rerun the job to finish it "
                          "(the response files need every input line)")
    return write_responses([out], Path(to), created)


def write_responses(folders: list[Path], target: Path, created: int | None, *,
                    errors_to: Path | None = None) -> ResponseFiles:
    """The response lines of `folders`' rows, in that order: to `target` each line with a custom_id (a
    line without one cannot be matched to its request, and the OpenAI schema has no null id), to
    `errors_to` (default `errors_file_for(target)`) each line with an error. Both files are always
    written, the errors file empty when nothing failed; each atomically (a temp file, fsynced, then
    renamed). One folder's rows in memory at a time."""
    created = int(time.time()) if created is None else created
    model = model_name(folders[0]) if folders else "batchjob"
    errors_to = errors_file_for(target) if errors_to is None else errors_to
    tmp, errors_tmp = (p.with_name(f".{p.name}.tmp") for p in (target, errors_to))
    written = failed = 0
    layer = disk()
    try:
        with File(layer, tmp) as results, File(layer, errors_tmp) as errors:
            for folder in folders:
                for line in response_lines(read_results(folder), model=model, created=created):
                    text = (json.dumps(line, ensure_ascii=False) + "\n").encode()
                    if line["custom_id"]:
                        results.write(text)
                        written += 1
                    if line["error"] is not None:
                        errors.write(text)
                        failed += 1
            results.sync()
            errors.sync()
        layer.rename(errors_tmp, errors_to)
        layer.rename(tmp, target)
    except BaseException:
        layer.discard(tmp)
        layer.discard(errors_tmp)
        raise
    for parent in dict.fromkeys((target.parent, errors_to.parent)):  # both names durable before they are reported
        layer.fsync_dir(parent)
    return ResponseFiles(target, written, errors_to, failed)


def model_name(out_dir: str | Path) -> str:
    """The model an output folder was made with, as its file or folder name (for the response bodies)."""
    manifest = Manifest.load(Path(out_dir))
    path = ((manifest.fingerprint if manifest else {}).get("model") or {}).get("path")
    if not path:
        return "batchjob"
    p = Path(path)
    return p.stem if p.suffix == ".gguf" else p.name
