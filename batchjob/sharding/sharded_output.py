"""A sharded job's output folder (OUT/job.json + OUT/shard-K-of-N/): every shard's state and progress
(with its Slurm task's state when squeue is there), and all shards exported back in input order."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from batchjob.sharding.shards import JOB_FILE, JobFile, ShardError, ShardRange, ShardSpec
from batchjob.io.export import ResponseFiles, export_folder_responses, write_responses
from batchjob.io.lock import lock_holder
from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.merge import FORMATS, ExportError, write_merged
from batchjob.io.ranges import RowRanges
from batchjob.sharding.slurm import last_submission, task_states
from batchjob.io.folder_status import FolderStatus, folder_status

__all__ = ["has_job_file", "is_planned_or_submitted", "ShardState", "shard_states", "sharded_status",
           "incomplete_message", "export_shards", "export_openai_batch", "ShardError"]


def has_job_file(out: str | Path) -> bool:
    """OUT/job.json is there: a shard has started and planned the job."""
    return (Path(out) / JOB_FILE).is_file()


def is_planned_or_submitted(out: str | Path) -> bool:
    """A sharded job's folder: job.json written, or submitted to Slurm and not started yet."""
    return has_job_file(out) or last_submission(Path(out)) is not None


@dataclass(slots=True)
class ShardState:
    index: int
    folder: Path
    range: ShardRange
    done: int  # committed rows
    started: bool  # has a manifest
    missing: RowRanges  # rows of the range not committed

    @property
    def complete(self) -> bool:
        return self.done == self.range.num_rows

    def describe_missing(self, most: int = 3) -> str:
        return self.missing.describe(most)


def shard_states(out: str | Path) -> tuple[JobFile, list[ShardState]]:
    """Every shard of a sharded output folder, started or not (raises ShardError when OUT is not one)."""
    out = Path(out)
    job = JobFile.load(out)
    if job is None:
        raise ShardError(f"{out} has no {JOB_FILE}; it is not a sharded job folder (or no shard has started yet)")
    states = []
    for index, rng in enumerate(job.ranges):
        folder = job.folder(out, index)
        try:
            manifest = Manifest.load(folder)
        except ManifestError as e:
            raise ShardError(str(e)) from e
        done = manifest.done_rows() if manifest is not None else RowRanges()
        missing = RowRanges((max(s, rng.start), e) for s, e in done.missing(rng.end).ranges() if e > rng.start)
        states.append(ShardState(index, folder, rng, rng.num_rows - missing.count(), manifest is not None, missing))
    return job, states



def sharded_status(out: str | Path, *, slurm: bool = True, now: float | None = None) -> dict:
    """The whole job and every shard, started or not: each started shard's folder as `batchjob status`
    sees a single folder (rows, errors, state from its lock and manifest, rate, ETA), plus its row
    range and its Slurm task's state (from squeue, when there is one and the job was submitted)."""
    out = Path(out)
    now = time.time() if now is None else now
    submission = last_submission(out) if slurm else None
    tasks = task_states(submission["job_id"]) if submission else None
    if has_job_file(out):
        job, states = shard_states(out)
        count, total = job.shards, job.total_rows
    elif submission is not None:  # submitted, no task has started yet
        states, count, total = [], submission["shards"], None
    else:
        raise ShardError(f"{out} is not a sharded job folder (no {JOB_FILE}, nothing submitted)")
    shards = []
    for k in range(count):
        s = states[k] if states else None
        if s is not None and s.started:
            f = asdict(folder_status(out, s.folder, now))
            f["state"] = "finished" if s.complete and f["state"] != "running" else f["state"]
        else:  # no manifest yet; a process may hold the lock while it loads the model
            name = ShardSpec(k, count).folder_name
            holder = lock_holder(out / name)
            f = asdict(FolderStatus(name, "running" if holder.held else "not started", pid=holder.pid, host=holder.host))
        f.pop("lanes")
        f.update(shard=k, start=s.range.start if s else None, end=s.range.end if s else None,
                 rows_done=s.done if s else 0, total_rows=s.range.num_rows if s else None,
                 missing=s.missing.to_json()[:20] if s else [], slurm_state=tasks.get(k) if tasks else None)
        shards.append(f)
    running = [f for f in shards if f["state"] == "running"]
    done = sum(f["rows_done"] for f in shards)
    rate = sum(f["rows_per_s"] or 0 for f in running) or None
    if running:
        state = "running"
    elif total is not None and done >= total:
        state = "finished"
    else:
        state = "not started" if all(f["state"] == "not started" for f in shards) else "stopped"
    return {
        "output": str(out), "state": state, "shards": count, "rows_done": done, "total_rows": total,
        "errors": sum(f["errors"] for f in shards),
        "prompt_tokens": sum(f["prompt_tokens"] for f in shards),
        "completion_tokens": sum(f["completion_tokens"] for f in shards),
        "rows_per_s": rate, "tokens_per_s": sum(f["tokens_per_s"] or 0 for f in running) or None,
        "eta_s": (total - done) / rate if rate and total is not None else None,
        "last_commit": max((f["last_commit"] for f in shards if f["last_commit"]), default=None),
        "slurm_job": submission["job_id"] if submission else None, "squeue": tasks is not None,
        "shard_states": shards,
    }


def incomplete_message(out: Path, states: list[ShardState]) -> str | None:
    missing = [s for s in states if not s.complete]
    if not missing:
        return None
    parts = [f"shard {s.index} ({s.folder.name}) lacks {s.missing.count()} of {s.range.num_rows} rows: "
             f"{s.describe_missing()}" + ("" if s.started else " (never started)") for s in missing]
    return (f"{out} is not complete: " + "; ".join(parts) +
            f". Rerun those shards (e.g. `sbatch --array=K {out}/slurm/batchjob.sbatch` or `batchjob run JOB --shard K/N`)")


# export


def export_shards(out: str | Path, to: str | Path, *, partial: bool = False) -> tuple[int, RowRanges]:
    """Write every committed row of every shard, in input order, to `to` (.parquet, .jsonl or .arrow),
    streaming like a single folder's export (all shards' parts merged by row_index, a few parts in
    memory). Refuses when a shard is incomplete, naming it and its missing rows, unless `partial`.
    Returns (rows written, rows missing)."""
    out, to = Path(out), Path(to)
    kind = FORMATS.get(to.suffix.lower())
    if kind is None:
        raise ShardError(f"--to {to}: unknown format {to.suffix!r}; use a file name ending in .parquet, .jsonl or .arrow")
    job, states = shard_states(out)
    problem = incomplete_message(out, states)
    if problem and not partial:
        raise ShardError(problem + "; or pass --partial to export the committed rows only")
    missing = RowRanges()
    for s in states:
        missing = missing.union(s.missing)
    # every shard's parts as parts of OUT, named by their path below it
    parts = [replace(part, name=f"{s.folder.name}/{part.name}")
             for s in states if s.started for part in Manifest.load(s.folder).parts]

    def check(rows: int) -> None:
        if rows + missing.count() != job.total_rows:
            raise ShardError(f"{out}: the shards hold {rows} rows and lack {missing.count()}, but {JOB_FILE} "
                             f"says the input has {job.total_rows}")

    return write_merged(out, parts, to, kind, check=check), missing


def export_openai_batch(out: str | Path, to: str | Path, *, created: int | None = None) -> ResponseFiles:
    """`batchjob export OUT --format openai-batch --to FILE`: OUT is one output folder or a sharded job
    folder (its shards in order); the errors go beside FILE (`errors_file_for`). Refuses when input rows
    are missing."""
    out = Path(out)
    if not has_job_file(out):
        return export_folder_responses(out, to, created=created)
    _, states = shard_states(out)
    problem = incomplete_message(out, states)
    if problem:
        raise ExportError(problem)
    return write_responses([s.folder for s in states if s.range.num_rows], Path(to), created)
