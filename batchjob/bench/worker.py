"""One bench process: loads one system with one model, warms it up, runs the requested workloads and prints
one `BENCH_RESULT {json}` line per workload. Its own process, so its peak RSS and start-up are its own.

    python -m batchjob.bench.worker --system batchjob --model bench/cache/tiny --workloads W1,W2 --spawned-at T
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MARK = "BENCH_RESULT "


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS, so each workload gets its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def warmup_workload():
    from batchjob.bench.workloads import Row, Workload

    rows = [Row(list(range(100, 100 + n)), 4) for n in (8, 24, 40, 16)]
    return Workload("warmup", "4 short rows", rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True)
    ap.add_argument("--model", required=True, help="HF folder")
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--rows", type=int, default=0, help="first N rows of each workload (0 = all)")
    ap.add_argument("--spawned-at", type=float, default=None, help="time.time() when the parent started this process")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    spawned = args.spawned_at or time.time()

    import torch

    from batchjob.bench.systems import make_runner
    from batchjob.bench.workloads import make

    if args.threads:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    runner = make_runner(args.system, args.model)
    load_s = time.perf_counter() - t
    runner.run(warmup_workload())
    startup_s = time.time() - spawned
    for name in args.workloads.split(","):
        wl = make(name)
        if args.rows:
            wl = wl.head(args.rows)
        reset_peak_rss()
        res = runner.run(wl)
        out = {
            "system": args.system, "workload": name, "rows": wl.num_rows, "threads": torch.get_num_threads(),
            "dtype": str(getattr(runner, "dtype", "")).removeprefix("torch."), "kernels": getattr(runner, "kernels", None),
            "load_s": load_s, "startup_s": startup_s, "peak_rss_mb": peak_rss_mb(),
            "useful_tokens": res.useful_tokens, "counted": res.counted, "token_times": res.token_times,
            "gen_s": res.gen_s, "computed_tokens": res.computed_tokens, "extra": res.extra,
        }
        print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
