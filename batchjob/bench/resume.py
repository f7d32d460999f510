"""Resume benchmark (issue 4): a JSONL job of N + 100 rows with max_tokens 1 on a tiny model, run with
--limit N (N rows committed); then, in a fresh `python -m batchjob run` process without the limit, the
time from its start to its first new row and its peak memory, for N = 10,000 and 100,000 (memory must not
grow with N), and once more with the recorded byte offset removed (the resume then reads and skips the
N rows).

    python -m batchjob.bench.resume [--rows 10000 100000] [--parts 100 100000] [--json FILE]

`--parts`: the same, with every committed row in its own part (N parts), to show that the time to the
first new row does not grow with the number of parts (a resume sizes every part and hashes the newest;
`batchjob verify` reads them all). The N parts are built by the real job with fsync skipped (building
100,000 parts durably would take minutes); the resume measured is a fresh process doing everything.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXTRA = 100  # rows left to do after the committed ones


def _job(folder: Path, model: str, part_rows: int) -> dict:
    """The job's fields: the fixture runs them through batchjob.run, the resume as `_flags` on the command line."""
    return dict(model=model, input=str(folder / "in.jsonl"), output=str(folder / "out"), max_tokens=1, progress=False,
                kv_cache_gb=0.05, swap_space_gb=0.01, max_num_seqs=512, max_num_batched_tokens=8192, part_rows=part_rows,
                part_seconds=1e9)


def _flags(job: dict) -> list[str]:
    """`job` as `batchjob run` flags, so the resumed process runs the very job the fixture built."""
    out = []
    for key, value in job.items():
        flag = "--" + key.replace("_", "-")
        out += ([flag] if value else ["--no-" + key.replace("_", "-")]) if isinstance(value, bool) else [flag, str(value)]
    return out


def build(folder: Path, model: str, committed: int, part_rows: int = 1000) -> dict:
    """The real job over committed + EXTRA input rows, run with --limit committed: the output then holds
    exactly `committed` rows, and a rerun without the limit continues (as after a stop at that point)."""
    from batchjob.api import run

    src = folder / "in.jsonl"
    with open(src, "w") as f:
        for i in range(committed + EXTRA):
            f.write(json.dumps({"prompt": f"w{3 + i % 1000} w{5 + i % 77} w42"}) + "\n")  # the tiny model's words
    fsync = os.fsync
    if part_rows < 1000:
        os.fsync = lambda fd: None  # the fixture only: its parts are complete files either way
    t0 = time.perf_counter()
    try:
        run(_job(folder, model, part_rows), limit=committed)
    finally:
        os.fsync = fsync
    return {"build_s": round(time.perf_counter() - t0, 1)}


def measure(folder: Path, model: str, part_rows: int = 1000) -> dict:
    """The resume, in a fresh `python -m batchjob run` process: seconds from its start to the first new row
    (the job's own first_row_unix stamp), the whole run, and the process's peak RSS (noisy: it includes
    model loading)."""
    from batchjob.bench.pipeline import summary_record

    out = folder / "out"
    cmd = [sys.executable, "-m", "batchjob", "run", *_flags(_job(folder, model, part_rows))]
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    done = time.time()
    err = proc.stderr.read()
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"the resume failed:\n{err[-3000:]}")
    info = summary_record(out)
    return {"first_row_s": round(info["first_row_unix"] - spawned, 2), "done_s": round(done - spawned, 2),
            "job_s": info["job_s"], "rows": info["sequences_finished"],
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


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
            print(f"{n:>7} committed of {n + EXTRA}: first new row {row['resume']['first_row_s']}s after start, "
                  f"peak RSS {row['resume']['peak_rss_mb']} MB; without the byte offset: first row "
                  f"{row['resume_without_offset']['first_row_s']}s (build {row['build_s']}s)", flush=True)
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
        log(f"{n:>7} committed parts: first new row {row['resume']['first_row_s']}s after start, done after "
            f"{row['resume']['done_s']}s, peak RSS {row['resume']['peak_rss_mb']} MB (build {row['build_s']}s)")
        shutil.rmtree(folder)
    return out


if __name__ == "__main__":
    sys.exit(main())
