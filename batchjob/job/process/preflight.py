"""What a run can tell before torch is imported or a model is loaded (seconds each): an output folder another run
holds, a missing or unreadable input, a missing column, a model that is not there, and a rerun of a job that is
already finished. `batchjob run` asks here first (cli/main.py); the Job (run.py) checks the same things again,
under the output lock, when the run goes on. A finished job is recognised only when its recorded fingerprint is
this run's: the input by content, the parameters, the model's files (models/identity.py); what `auto` chose on the
machine that ran it (the compute dtype; a pre-quantized checkpoint's matmuls) is taken as recorded, since a
finished job computes nothing more. Anything less certain goes on to the Job, which says what differs."""
from __future__ import annotations

import json
from pathlib import Path

from batchjob.io.export import responses_written
from batchjob.io.lock import check_free
from batchjob.io.manifest import MANIFEST, Manifest, ManifestError
from batchjob.io.ranges import RowRanges
from batchjob.io.recovery import same_job
from batchjob.job.options.config import JobConfig
from batchjob.job.rows.embed_task import resolve_pooling
from batchjob.job.error_budget import job_failure
from batchjob.job.options.fingerprint import ModelFacts, fingerprint
from batchjob.job.inputs import OpenedInput, input_folders, open_inputs, output_folder, with_tool_parser
from batchjob.job.options.modes import OutputFormat, Quantization
from batchjob.job.report.summary import JobSummary
from batchjob.models.identity import model_identity
from batchjob.models.location import model_source, resolve_model_path


def preflight(cfg: JobConfig, restart: bool = False) -> JobSummary | None:
    """A finished job's summary (its rerun's verdict: raises AllRowsFailed / TooManyErrors as the job ended), or
    None when the job is to run. Raises LockHeld, ConfigError, SourceError or ModelLoadError for what cannot run."""
    out, shard = output_folder(cfg)
    check_free(out)  # another run holds the folder: refused before anything else is read
    sources, _, empty_inputs = open_inputs(cfg, input_folders(cfg, out))
    cfg = with_tool_parser(cfg, sources)  # as the Job's: its fingerprint
    path = resolve_model_path(cfg.model)
    model = model_source(path)
    if restart or shard is not None or empty_inputs:  # a shard's slice and its claim are the Job's to check
        return None
    return _finished(resolve_pooling(cfg, path), out, sources, model)  # an embed job's pooling, as the Job's


def _finished(cfg: JobConfig, out: Path, sources: list[OpenedInput], model: Path) -> JobSummary | None:
    rows = errors = total = 0
    first_error = None
    identity = None
    for source, path, folder, _ in sources:
        try:
            manifest = Manifest.load(folder) if (folder / MANIFEST).is_file() else None
        except ManifestError:
            return None  # the Job repairs or refuses it
        if manifest is None:
            return None
        if source.num_rows is not None and manifest.total_rows is not None and source.num_rows != manifest.total_rows:
            return None  # the Job says how the input changed (a JSONL input is counted as it is read)
        wanted = rows_of_finished_run(manifest.total_rows, manifest.done_rows(), cfg.limit)
        if wanted is None:
            return None
        whole = wanted == manifest.total_rows  # not a trial run's first rows: the response files are due
        if cfg.output_format == OutputFormat.OPENAI_BATCH and whole and not responses_written(folder):
            return None  # every row is in, the response files are not (a crash before them): the Job writes them
        recorded = manifest.fingerprint or {}
        params, recorded_model = recorded.get("params") or {}, recorded.get("model") or {}
        if identity is None:
            identity = model_identity(model, recorded_model.get("architecture", ""))
        quantization = cfg.quantization
        if quantization == Quantization.AUTO:  # a float checkpoint: none; a pre-quantized one: its own, as it ran
            quantization = params.get("quantization", "none") if _prequantized(model) else "none"
        facts = ModelFacts(identity, cfg.dtype or params.get("dtype", ""), quantization)
        if not same_job(recorded, fingerprint(cfg, source, path, facts)):
            return None  # the Job says what differs
        total += wanted
        totals = manifest.totals()
        rows, errors = rows + totals["rows"], errors + totals["errors"]
        first_error = first_error or (manifest.extra.get("run") or {}).get("first_error")
    summary = JobSummary(output=str(out), rows_before=rows, errors_before=errors, total_rows=total, already_finished=True)
    failure = job_failure(cfg.max_errors, total, str(out), rows, errors, first_error, rerun=True)
    if failure is not None:
        raise failure
    return summary


def rows_of_finished_run(total_rows: int | None, done: RowRanges, limit: int | None) -> int | None:
    """The rows a run with this --limit (None: none) has to do on a folder, when every one of them is committed:
    the input's rows, or its first `limit` (a trial run, finished though the rest of a JSONL input is unread and
    uncounted); None while some are not committed, or the input's end is unknown and no limit ends the run."""
    if total_rows is None:
        return limit if limit is not None and done.covers(0, limit) else None
    wanted = total_rows if limit is None else min(total_rows, limit)
    return wanted if done.count() >= wanted else None


def _prequantized(model: Path) -> bool:
    """An HF folder whose config.json names a quantization (models/compressed_tensors.py reads it); a GGUF file is
    dequantized or re-quantized at load as the job asks, never fixed."""
    if not model.is_dir():
        return False
    try:
        return "quantization_config" in json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unreadable here: the Job says why
