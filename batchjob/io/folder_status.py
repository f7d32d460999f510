"""`batchjob status OUT`: how far a job is, from its manifests and lock alone (no part is read, except
for the per-lane counts of a `lane` column).

OUT and every folder below it that holds a manifest is one result folder: a job's folder, its
per-lane folders (OUT/<lane>/), shard folders (OUT/shard-K-of-N/). A folder runs when the lock of
the nearest folder above it (itself included) that has one is held.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from batchjob.io.parts import part_schema, read_part

from batchjob.io.export import job_total, missing_rows, run_limit
from batchjob.io.lock import LOCK_NAME, lock_holder
from batchjob.io.manifest import Manifest, ManifestError, result_folders


@dataclass(slots=True)
class FolderStatus:
    folder: str  # relative to OUT ("." for OUT itself)
    state: str  # running | finished | stopped | failed | killed | unknown (unreadable manifest)
    rows_done: int = 0
    total_rows: int | None = None  # the input's rows; after a --limit N run, N (at most the input's rows)
    total_estimate: int | None = None  # JSONL read partway: rows per byte so far x the file's bytes
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rows_per_s: float | None = None  # the current (or last) run
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_commit: float | None = None  # epoch seconds
    pid: int | None = None  # the process holding the lock
    host: str | None = None
    note: str | None = None  # how the last run ended, or what is wrong with the folder
    missing: list[list[int]] = field(default_factory=list)  # first missing row ranges, when the total is known
    lanes: dict[str, dict] = field(default_factory=dict)  # lane column: {lane: {rows, errors}}
    # the last run's process: its peak resident memory in bytes, at the run's end or (running, killed) its last
    # commit; None for a run recorded before batchjob kept it
    peak_rss_bytes: int | None = None


def status(out: str | Path, *, now: float | None = None) -> dict:
    """The job in OUT: totals over its result folders, and each folder."""
    out = Path(out)
    now = time.time() if now is None else now
    folders = [folder_status(out, f, now) for f in result_folders(out)]
    if not folders:
        raise ManifestError(f"{out} has no manifest.json (nor a folder below it); it is not a batchjob output "
                            "folder, or no job has started in it yet")
    totals = [f.total_rows for f in folders]
    total = None if None in totals else sum(totals)
    estimates = [f.total_rows if f.total_rows is not None else f.total_estimate for f in folders]
    estimate = None if total is not None or None in estimates else sum(estimates)
    done = sum(f.rows_done for f in folders)
    running = [f for f in folders if f.state == "running"]
    timed = running or folders  # throughput of the runs going on, else of the last runs
    rate = sum(f.rows_per_s or 0 for f in timed) or None
    states = {f.state for f in folders}
    state = "running" if running else states.pop() if len(states) == 1 else "stopped"
    if total is not None and done >= total and not running:
        state = "failed" if "failed" in states or state == "failed" else "finished"
    lanes: dict[str, dict] = {}
    for f in folders:
        for name, counts in f.lanes.items():
            into = lanes.setdefault(name, {"rows": 0, "errors": 0})
            into["rows"] += counts["rows"]
            into["errors"] += counts["errors"]
    return {
        "output": str(out), "state": state, "rows_done": done, "total_rows": total, "total_estimate": estimate,
        "errors": sum(f.errors for f in folders),
        "prompt_tokens": sum(f.prompt_tokens for f in folders),
        "completion_tokens": sum(f.completion_tokens for f in folders),
        "rows_per_s": rate, "tokens_per_s": sum(f.tokens_per_s or 0 for f in timed) or None,
        "eta_s": max(0, (total if total is not None else estimate) - done) / rate
        if running and rate and (total is not None or estimate is not None) else None,
        "last_commit": max((f.last_commit for f in folders if f.last_commit), default=None),
        # the largest of the last runs' processes (per-lane folders share one process, shards have their own)
        "peak_rss_bytes": max((f.peak_rss_bytes for f in folders if f.peak_rss_bytes), default=None),
        "lanes": lanes,
        "folders": [asdict(f) for f in folders],
    }


def folder_status(out: Path, folder: Path, now: float) -> FolderStatus:
    name = "." if folder == out else str(folder.relative_to(out))
    holder = lock_holder(_lock_folder(out, folder))
    try:
        manifest = Manifest.load(folder) or Manifest.load(folder, "manifest.json.prev")
    except ManifestError as e:
        return FolderStatus(name, "running" if holder.held else "unknown", pid=holder.pid, host=holder.host,
                            note=f"{e} (the next run repairs it)")
    totals = manifest.totals()
    st = FolderStatus(name, "unknown", rows_done=totals["rows"], total_rows=job_total(manifest), errors=totals["errors"],
                      prompt_tokens=totals["prompt_tokens"], completion_tokens=totals["completion_tokens"],
                      last_commit=manifest.extra.get("last_commit"), pid=holder.pid, host=holder.host)
    run = manifest.extra.get("run") or {}
    peak = run.get("peak_rss_bytes")
    st.peak_rss_bytes = peak if isinstance(peak, int) and peak > 0 else None
    if holder.held:
        st.state = "running"
    elif run.get("state") in ("finished", "stopped", "failed"):
        st.state = run["state"]
        if run["state"] == "stopped" and run.get("reason"):
            st.note = f"stopped: {run['reason']}; free space and rerun the same command to continue"
        elif run["state"] == "stopped" and run.get("signal"):
            st.note = f"stopped by {run['signal']}; rerun the same command to continue"
        elif run["state"] == "failed":
            st.note = run.get("error")
    elif run.get("state") == "running":
        st.state = "killed"
        st.note = "the last run ended without committing its end (killed, crashed or lost its node); rerun to continue"
    else:
        st.state = "stopped"  # written by a batchjob that kept no run record
    if run.get("started"):
        end = now if st.state == "running" else (run.get("ended") or st.last_commit or now)
        elapsed = end - run["started"]
        if elapsed > 0:
            st.rows_per_s = (st.rows_done - run.get("rows_at_start", 0)) / elapsed
            st.tokens_per_s = (st.completion_tokens - run.get("completion_tokens_at_start", 0)) / elapsed
    limit = run_limit(manifest)
    if limit is not None and st.total_rows != manifest.total_rows and not st.note:
        st.note = (f"a trial run: --limit {limit:,}, so the job holds the input's first {st.total_rows:,} rows; "
                   "rerun without --limit to continue with the rest")
    missing = missing_rows(manifest)
    if missing is not None:
        st.missing = missing.to_json()[:20]
        if st.state == "running" and st.rows_per_s:
            st.eta_s = missing.count() / st.rows_per_s
        if not missing and st.state not in ("running", "failed"):
            st.state = "finished"  # every row is in, however the last run ended
    else:
        st.total_estimate = _estimate_total(manifest)
        if st.total_estimate is not None and st.state == "running" and st.rows_per_s:
            st.eta_s = max(0, st.total_estimate - st.rows_done) / st.rows_per_s
    st.lanes = _lane_counts(folder, manifest)
    return st


def _estimate_total(manifest: Manifest) -> int | None:
    """A JSONL job's row count before its reader reached the end: from the resume point (row, byte)
    and the file's size in the fingerprint."""
    position = manifest.extra.get("resume_position")
    source = manifest.fingerprint.get("input")
    files = (source.get("files") if isinstance(source, dict) else None) or []
    try:
        row, offset = int(position[0]), int(position[1])
        size = int(files[0][1]) if len(files) == 1 else None
    except (TypeError, ValueError, IndexError):
        return None
    if not size or row <= 0 or offset <= 0:
        return None
    return max(row, round(row * size / offset))


def _lock_folder(out: Path, folder: Path) -> Path:
    """The folder whose lock covers `folder`: the nearest one up to OUT that has a lock file."""
    for candidate in (folder, *folder.parents):
        if (candidate / LOCK_NAME).exists():
            return candidate
        if candidate == out:
            break
    return out


def _lane_counts(folder: Path, manifest: Manifest) -> dict[str, dict]:
    counts: dict[str, dict] = {}
    for part in manifest.parts:
        try:
            if "lane" not in part_schema(folder / part.name).names:
                return {}
            table = read_part(folder / part.name).select(["lane", "finish_reason"])
        except (OSError, pa.ArrowException):
            continue  # a damaged part: the next run sets it aside
        for lane, reason in zip(table.column("lane").to_pylist(), table.column("finish_reason").to_pylist()):
            into = counts.setdefault(str(lane), {"rows": 0, "errors": 0})
            into["rows"] += 1
            into["errors"] += reason == "error"
    return counts
