"""Resume benchmark (issue 4): a JSONL job of N + 100 rows with max_tokens 1 on a tiny model, killed once
N rows are committed; then the time from the resuming process's start to its first new row, its peak
memory, and how many input lines it read, for N = 10,000 and 100,000 (memory must not grow with N),
and once more with the recorded byte offset removed (the resume then reads and skips the N rows).

    python -m batchjob.bench.resume [--rows 10000 100000] [--parts 100 100000] [--json FILE]

`--parts`: the same, with every committed row in its own part (N parts), to show that the time to the
first new row does not grow with the number of parts (a resume sizes every part and hashes the newest;
`batchjob verify` reads them all). The N parts are built by the real job with fsync skipped (building
100,000 parts durably would take minutes); the resume measured is a fresh process doing everything.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXTRA = 100  # rows left to do after the committed ones


class _Killed(BaseException):
    pass


def build(folder: Path, model: str, committed: int, part_rows: int = 1000) -> dict:
    """Run the real job over committed + EXTRA rows and stop it, like a SIGKILL, once `committed` rows
    are committed (rows finish in input order here: max_tokens 1, parts of `part_rows` rows)."""
    import os
    from batchjob.config import load_job
    from batchjob.job import Job
    from batchjob.stats import StatsRecorder

    src = folder / "in.jsonl"
    with open(src, "w") as f:
        for i in range(committed + EXTRA):
            f.write(json.dumps({"prompt": f"w{3 + i % 1000} w{5 + i % 77} w42"}) + "\n")  # the tiny model's words
    cfg = load_job(None, _job(folder, model, part_rows))
    job = Job(cfg)
    step = StatsRecorder.step
    fsync = os.fsync
    if part_rows < 1000:
        os.fsync = lambda fd: None  # the fixture only: its parts are complete files either way

    def stop_at_committed(self, *args):
        step(self, *args)
        if job.summary.rows >= committed:
            raise _Killed

    StatsRecorder.step = stop_at_committed
    t0 = time.perf_counter()
    try:
        job.run()
    except _Killed:
        pass
    finally:
        StatsRecorder.step = step
        os.fsync = fsync
        for stream in job.streams:
            stream.sink.sync()  # what was handed to the writer is committed, as at a kill after those commits
        job.lock.release()
    return {"build_s": round(time.perf_counter() - t0, 1)}


def _job(folder: Path | str, model: str, part_rows: int = 1000) -> dict:
    folder = Path(folder)
    return dict(model=model, input=str(folder / "in.jsonl"), output=str(folder / "out"), max_tokens=1, progress=False,
                kv_cache_gb=0.05, swap_space_gb=0.01, max_num_seqs=512, max_num_batched_tokens=8192, part_rows=part_rows,
                part_seconds=1e9)


def measure(folder: Path, model: str, part_rows: int = 1000) -> dict:
    """In a fresh process: seconds from its start to the first new row, peak RSS (noisy: it includes model
    loading), the peak of Python objects while the job opens and runs (manifest, row ranges, resume
    positions: what would grow with committed rows), input lines read (past the first lines every
    open samples for the column names)."""
    code = f"""
import time; t0 = time.perf_counter()
import json, resource, sys
from batchjob.config import load_job
from batchjob.io.sources import JsonlSource
from batchjob.job import Job
from batchjob.bench.resume import _job
lines = JsonlSource._lines
scanned = [0]
def counting(self, *a):
    for item in lines(self, *a):
        scanned[0] += 1
        yield item
JsonlSource._lines = counting
imported = time.perf_counter() - t0
import tracemalloc; tracemalloc.start()  # Python objects only (not tensors): what could grow with committed rows
job = Job(load_job(None, _job({str(folder)!r}, {model!r}, {part_rows})))
opened = time.perf_counter() - t0
first = []
emit = Job._emit
def timed(self, *a, **k):
    if not first:
        first.append(time.perf_counter() - t0)
    return emit(self, *a, **k)
Job._emit = timed
summary = job.run()
print(json.dumps({{"imports_s": round(imported, 2), "job_open_s": round(opened, 2), "first_row_s": round(first[0], 2),
                  "done_s": round(time.perf_counter() - t0, 2), "rows": summary.rows, "lines_read": scanned[0] - JsonlSource.sample_lines,
                  "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "python_heap_peak_mb": round(tracemalloc.get_traced_memory()[1] / 2**20, 2)}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the resume failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def forget_offset(out: Path) -> None:
    from batchjob.io.manifest import Manifest

    manifest = Manifest.load(out)
    manifest.extra.pop("resume_position", None)
    manifest.commit(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchjob.bench.resume", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000], help="committed rows to resume after")
    parser.add_argument("--model", help="an HF folder (default: the benchmark's tiny Llama, bench/cache/tiny)")
    parser.add_argument("--parts", type=int, nargs="*", default=[100, 100_000], help="committed one-row parts to resume after")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from batchjob.bench.models import prepare

        model = prepare("tiny").path
    results = []
    with tempfile.TemporaryDirectory(prefix="batchjob-resume-bench-") as tmp:
        for n in args.rows:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            row = {"committed": n, "total": n + EXTRA, **build(folder, model, n)}
            shutil.copytree(folder / "out", folder / "copy")
            row["resume"] = measure(folder, model)
            shutil.rmtree(folder / "out")
            (folder / "copy").rename(folder / "out")
            forget_offset(folder / "out")
            row["resume_without_offset"] = measure(folder, model)
            results.append(row)
            print(f"{n:>7} committed of {n + EXTRA}: first new row {row['resume']['first_row_s']}s after start "
                  f"(imports {row['resume']['imports_s']}s, job open {row['resume']['job_open_s']}s), "
                  f"peak RSS {row['resume']['peak_rss_mb']} MB (Python objects {row['resume']['python_heap_peak_mb']} MB), "
                  f"{row['resume']['lines_read']} input lines read; "
                  f"without the byte offset: first row {row['resume_without_offset']['first_row_s']}s, "
                  f"{row['resume_without_offset']['lines_read']} lines read (build {row['build_s']}s)", flush=True)
        parts = measure_parts(args.parts, model, tmp)
    if args.json:
        args.json.write_text(json.dumps({"rows": results, "parts": parts}, indent=1))
    return 0


def measure_parts(counts: list[int], model: str, tmp: str | Path, log=print) -> list[dict]:
    """Resume after N committed one-row parts: seconds from process start to the first new row."""
    out = []
    for n in counts:
        folder = Path(tmp) / f"parts-{n}"
        folder.mkdir()
        row = {"parts": n, **build(folder, model, n, part_rows=1)}
        row["resume"] = measure(folder, model, part_rows=1)
        out.append(row)
        log(f"{n:>7} committed parts: first new row {row['resume']['first_row_s']}s after start (imports "
            f"{row['resume']['imports_s']}s, job open {row['resume']['job_open_s']}s), peak RSS "
            f"{row['resume']['peak_rss_mb']} MB (build {row['build_s']}s)")
        shutil.rmtree(folder)
    return out


if __name__ == "__main__":
    sys.exit(main())
