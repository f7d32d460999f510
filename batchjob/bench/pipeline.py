"""Input -> output pipeline overhead: real `batchjob run` jobs (source -> engine -> Arrow sink) with
max_tokens 1 on the tiny model, at 10,000 and 100,000 rows (rows/s, peak RSS), and the time to resume
a 99%-done job.

Each job is a plain `python -m batchjob run ...` child process; the parent takes its peak RSS from
wait4() and everything else from the job's own summary record at the end of OUTPUT/stats.jsonl (rows
finished, the job's seconds, the seconds inside the model, when the first row finished).

The 99%-done job is a real crash state, not an edited one: while the 100,000-row job runs, the parent
copies the commit files (manifest.json, its previous snapshot and the commit logs) the moment they list
>= 99% of the rows. After the job ends, those copies are put back; the parts they do not list are what
a crash after that commit would have left, and the resumed job must sweep them and redo only those
rows."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPT_WORDS = 4  # tokens per prompt with the tiny model's word-level tokenizer: little model work per row


def make_input(path: Path, rows: int, fmt: str, seed: int = 0) -> Path:
    rng = random.Random(seed)
    prompts = [" ".join(f"w{rng.randrange(3, 32000)}" for _ in range(PROMPT_WORDS)) for _ in range(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(rows)), "prompt": prompts}), path, row_group_size=10_000)
    else:
        raise ValueError(f"format {fmt!r}: jsonl or parquet")
    return path


COMMIT_FILES = ("manifest.json", "manifest.json.prev", "commits.log", "commits.log.prev")


def _manifest_rows(out: Path) -> tuple[int, dict | None]:
    """Rows committed in `out`, and the commit files' bytes (the folder's whole commit state)."""
    from batchjob.io.manifest import Manifest

    try:
        data = {name: (out / name).read_bytes() for name in COMMIT_FILES if (out / name).exists()}
        manifest = Manifest.load(out)
        return (manifest.num_rows() if manifest else 0), data
    except Exception:  # noqa: BLE001 - a reader may race the writer; the next look sees a whole state
        return 0, None


def run_job(model: str, input_path: Path, out: Path, *, engine_flags: list[str], snapshot_at: int = 0,
            total_rows: int = 0, timeout: float = 3600) -> dict:
    """One `batchjob run` in a child process. With `snapshot_at`, also returns the last manifest.json that
    listed at least snapshot_at and fewer than total_rows rows."""
    args = ["run", "--model", model, "--input", str(input_path), "--output", str(out), "--max-tokens", "1",
            "--ignore-eos", "--no-progress", *engine_flags]
    cmd = [sys.executable, "-m", "batchjob", *args]
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshot: dict = {}
    done = threading.Event()

    def watch():  # keeps the last manifest that listed at least snapshot_at rows but not all of them
        seen = None
        while not done.is_set():
            try:
                key = tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in
                            ((out / name).stat() for name in COMMIT_FILES[::2] if (out / name).exists()))
            except OSError:
                key = None
            if key is not None and key != seen:
                seen = key
                rows, data = _manifest_rows(out)
                if data is not None and snapshot_at <= rows < total_rows:
                    snapshot.update(rows=rows, data=data)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True) if snapshot_at else None
    if watcher:
        watcher.start()
    # read the pipes on threads so a chatty child cannot block, and wait4 for its own rusage
    streams: dict[str, str] = {}
    readers = [threading.Thread(target=lambda k=k, s=s: streams.__setitem__(k, s.read()), daemon=True)
               for k, s in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    deadline = time.time() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.time() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.02)
    exited = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    for r in readers:
        r.join(5)
    info = summary_record(out) if proc.returncode == 0 else {}
    rows, _ = _manifest_rows(out)
    result = {
        "rc": proc.returncode, "process_s": exited - spawned, "peak_rss_mb": usage.ru_maxrss / 1024,
        "rows_committed": rows, "rows_written": info.get("sequences_finished"),
        "first_row_s": info["first_row_unix"] - spawned if info.get("first_row_unix") else None,
        "summary": streams.get("err", "").strip().splitlines()[-1:], "engine_flags": engine_flags,
    }
    n = info.get("sequences_finished")
    if n and info.get("first_row_unix"):
        end = info["started_unix"] + info["job_s"]
        result["steady_rows_s"] = n / max(1e-9, end - info["first_row_unix"])
    if n and info.get("job_s"):
        result.update(job_s=info["job_s"], model_s=info["model_s"], job_rows_s=n / info["job_s"],
                      overhead_rows_s=n / max(1e-9, info["job_s"] - info["model_s"]))
    if result["rows_written"]:
        result["rows_s"] = result["rows_written"] / result["process_s"]
    if proc.returncode != 0:
        result["error"] = (streams.get("err", "") or "")[-2000:]
    if snapshot_at:
        result["snapshot"] = snapshot
    return result


def measure(work: Path, model: str, sizes=(10_000, 100_000), fmt: str = "jsonl",
            engine_flags: tuple[str, ...] = ("--max-num-seqs", "512", "--max-num-batched-tokens", "8192"),
            log=print) -> dict:
    """Rows/s and peak RSS per size; resume of the largest size from its 99% crash state."""
    flags = list(engine_flags)
    res: dict = {"format": fmt, "model": model, "max_tokens": 1, "prompt_tokens_per_row": PROMPT_WORDS, "runs": {}}
    largest = max(sizes)
    for n in sizes:
        inp = make_input(work / f"in-{n}.{fmt}", n, fmt)
        out = work / f"out-{n}"
        shutil.rmtree(out, ignore_errors=True)
        snap = int(0.9 * n) if n == largest else 0  # the last commit before the end: 99% with 1000-row parts
        r = run_job(model, inp, out, engine_flags=flags, snapshot_at=snap, total_rows=n)
        snapshot = r.pop("snapshot", None)
        res["runs"][str(n)] = r
        log(f"  pipeline {fmt} {n:,} rows: rc {r['rc']}, {r.get('rows_s') or 0:,.0f} rows/s whole process, "
            f"{r.get('job_rows_s') or 0:,.0f} in the job, {r.get('overhead_rows_s') or 0:,.0f} outside the model "
            f"forward, peak RSS {r['peak_rss_mb']:.0f} MB")
        if n == largest:
            res["resume"] = resume(model, inp, out, flags, r, snapshot, log)
    runs = res["runs"]
    lo, hi = str(min(sizes)), str(largest)
    if lo != hi and runs[lo].get("peak_rss_mb") and runs[hi].get("peak_rss_mb"):
        res["rss_growth"] = runs[hi]["peak_rss_mb"] / runs[lo]["peak_rss_mb"] - 1
    return res


def resume(model: str, inp: Path, out: Path, flags: list[str], full: dict, snapshot: dict | None, log) -> dict:
    if full["rc"] != 0:
        return {"status": "skipped: the full job failed"}
    if not snapshot or "data" not in snapshot:
        return {"status": "skipped: no manifest listing 99% of the rows was seen (parts too large or too fast)"}
    total = full["rows_committed"]
    if snapshot["rows"] >= total:
        return {"status": "skipped: the job committed everything at once (no 99% state)"}
    for name in COMMIT_FILES:  # the state right after that commit
        if name in snapshot["data"]:
            (out / name).write_bytes(snapshot["data"][name])
        else:
            (out / name).unlink(missing_ok=True)
    r = run_job(model, inp, out, engine_flags=flags)
    r.update(status="ok" if r["rc"] == 0 and r["rows_committed"] == total else "failed",
             done_before=snapshot["rows"], total_rows=total)
    log(f"  resume from {snapshot['rows']:,}/{total:,} rows: first new row after {r.get('first_row_s') or 0:.2f}s, "
        f"done after {r['process_s']:.2f}s ({r['rows_written'] or 0:,} rows redone), {r['status']}")
    return r


def summary_record(out: Path) -> dict:
    """The job's own account of the run: the summary record stats.jsonl ends with (public counters: rows
    finished, seconds in the job, the engine's steps and the model alone, when the first row finished)."""
    try:
        lines = (out / "stats.jsonl").read_text().splitlines()
    except OSError:
        return {}
    return next((json.loads(line) for line in reversed(lines) if '"summary": true' in line), {})
