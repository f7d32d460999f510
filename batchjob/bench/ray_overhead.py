"""Ray's overhead (issue 35): the same 4-shard job as `batchjob ray submit` on a local Ray (one CPU a shard, so two
shards at a time on a 2-core machine), with each runner (a long-lived actor per slot, or a task per shard), and as
four plain `batchjob run JOB --shard K/4` processes, two at a time, one thread each. Wall time of each whole run,
alternating, and each runner's ratio to plain (target: Ray <= 1.15x plain).

    python -m batchjob.bench.ray_overhead [--rows 292] [--max-tokens 32] [--rounds 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchjob.bench import report
from batchjob.bench.paths import PROMPTS, ROOT

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def job_file(folder: Path, rows: int, max_tokens: int, out: Path) -> Path:
    lines = PROMPTS.read_text().splitlines()[:rows]
    src = folder / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    path = folder / f"{out.name}.toml"
    path.write_text(f'model = "smollm2"\ninput = "{src}"\noutput = "{out}"\nchat = true\n[sampling]\n'
                    f"max_tokens = {max_tokens}\nignore_eos = true\n[engine]\nmax_num_seqs = 32\n")
    return path


def plain(job: Path, shards: int, at_once: int) -> float:
    t0 = time.perf_counter()
    for first in range(0, shards, at_once):
        procs = [subprocess.Popen([sys.executable, "-m", "batchjob", "run", str(job), "--shard", f"{k}/{shards}",
                                   "--threads", "1", "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for k in range(first, min(shards, first + at_once))]
        for p in procs:
            if p.wait():
                raise RuntimeError(p.stderr.read().decode()[-800:])
    return time.perf_counter() - t0


def on_ray(job: Path, shards: int, runner: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "batchjob", "ray", "submit", str(job), "--shards", str(shards),
                           "--cpus-per-shard", "1", "--runner", runner], cwd=ROOT, env=ENV, capture_output=True,
                          text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-800:])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=292)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {"plain": [], "actors": [], "tasks": []}
    with tempfile.TemporaryDirectory(prefix="batchjob-ray-bench-") as tmp:
        folder = Path(tmp)
        for _ in range(args.rounds):
            for name in times:
                out = folder / name
                shutil.rmtree(out, ignore_errors=True)
                job = job_file(folder, args.rows, args.max_tokens, out)
                times[name].append(plain(job, 4, 2) if name == "plain" else on_ray(job, 4, name))
                print(f"  {name}: {times[name][-1]:.1f} s", file=sys.stderr)
    best = {k: min(v) for k, v in times.items()}
    ratios = {name: best[name] / best["plain"] for name in ("actors", "tasks")}
    result = {"rows": args.rows, "max_tokens": args.max_tokens, "times_s": times, "best_s": best, "ratios": ratios}
    print(f"ray overhead: {args.rows} rows x {args.max_tokens} tokens, 4 shards, 2 at a time: plain "
          f"{best['plain']:.1f} s; ray with actors {best['actors']:.1f} s ({ratios['actors']:.2f}x), with tasks "
          f"{best['tasks']:.1f} s ({ratios['tasks']:.2f}x) (target <= 1.15x)", file=sys.stderr)
    if args.json:
        report.write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
