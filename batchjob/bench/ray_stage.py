"""The Ray Data stage's speed (issue 35): 200 of the sample prompts (jobs/data/prompts.jsonl) x 32 tokens on SmolLM2,
once through `ds.map_batches(LLMStage, concurrency=1, batch_size=200)` on a local Ray, once as `batchjob run` on the
same rows. Each side's rows/s over its own engine work (the stage: the time inside its __call__, read from a timing
column a bench-only subclass adds, the model's load left out; the job: its summary's job seconds), and each side's
whole time (the stage: from `map_batches` to `take_all`, the actor's start and model load included; the job: the
whole process).

    python -m batchjob.bench.ray_stage [--rows 200] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchjob.ray.stage import LLMStage
from batchjob.bench import report
from batchjob.bench.paths import PROMPTS

ENGINE = {"max_num_seqs": 64}


class TimedStage(LLMStage):
    """LLMStage with the seconds its batch took inside the actor, as a column."""

    def __call__(self, batch):
        self.server  # the model loads at the first batch (ray/stage.py LLMStage): not engine work
        t0 = time.perf_counter()
        out = super().__call__(batch)
        out["stage_s"] = [time.perf_counter() - t0] * len(out["generated_text"])
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [json.loads(x) for x in PROMPTS.read_text().splitlines()][:args.rows]
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "batchjob", "run", "--model", "smollm2", "--input", str(src),
                               "--output", str(Path(tmp) / "out"), "--max-tokens", str(args.max_tokens), "--ignore-eos",
                               "--chat", "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--no-progress"],
                              capture_output=True, text=True)
        run_whole = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(proc.stderr[-1500:])
        run_job = json.loads((Path(tmp) / "out" / "stats.jsonl").read_text().splitlines()[-1])["job_s"]
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 << 20)
    try:
        t0 = time.perf_counter()
        got = ray.data.from_items(rows).map_batches(
            TimedStage, fn_constructor_kwargs={"model": "smollm2", "engine": ENGINE, "max_tokens": args.max_tokens,
                                               "ignore_eos": True, "chat": True},
            concurrency=1, batch_size=len(rows), num_cpus=2).take_all()
        stage_whole = time.perf_counter() - t0
    finally:
        ray.shutdown()
    stage_s = max(r["stage_s"] for r in got)
    result = {"rows": len(rows), "max_tokens": args.max_tokens, "run_job_s": run_job, "run_whole_s": run_whole,
              "stage_s": stage_s, "stage_whole_s": stage_whole}
    print(f"  Ray Data stage: {len(rows)} rows x {args.max_tokens} tokens: engine work {stage_s:.1f} s in the actor "
          f"({len(rows) / stage_s:.1f} rows/s) vs `batchjob run` {run_job:.1f} s in the job ({len(rows) / run_job:.1f} "
          f"rows/s): {run_job / stage_s:.2f} of the job's rows/s (target >= 0.85); whole: {stage_whole:.1f} s "
          f"(actor start and model load in) vs {run_whole:.1f} s process", file=sys.stderr)
    if args.json:
        report.write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
