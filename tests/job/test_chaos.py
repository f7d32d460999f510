"""Chaos: SIGKILL a running `batchjob run` at random (seeded) moments, rerun it until it finishes, and
check that the export holds every input row exactly once with the same text as an uninterrupted run,
for greedy and sampled rows alike.

`BATCHJOB_CHAOS_KILLS` sets the number of kills (default 5; `make chaos` runs 100), `BATCHJOB_CHAOS_SEED`
the kill moments, `BATCHJOB_CHAOS_DTYPE` the dtype (default: the CPU's default, bfloat16 where it has bf16
matmul). Identical text after a resume in bfloat16 rests on the native kernels' batch invariance."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchjob.io.lock import lock_holder
from batchjob.io.manifest import Manifest
from tests.builders import exported

REPO = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("BATCHJOB_CHAOS_KILLS", "5"))
ROWS = max(300, 40 * KILLS)  # enough work left for every kill (a commit can bring a burst of rows)
SEED = int(os.environ.get("BATCHJOB_CHAOS_SEED", "2024"))
DTYPE = os.environ.get("BATCHJOB_CHAOS_DTYPE", "")  # "" = the default dtype (bfloat16 on CPUs with bf16 matmul)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def start(args: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchjob.cli.main", "run", *map(str, args)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def committed(out: Path) -> int:
    try:
        manifest = Manifest.load(out)
    except Exception:  # noqa: BLE001 - a reader may race the writer's first commit; try again
        return -1
    return manifest.done_rows().count() if manifest else 0


def export(out: Path, to: Path) -> list[dict]:
    return exported(out, to, ["row_index", "generated_text", "finish_reason", "completion_tokens"])


def test_sigkill_at_random_moments_then_rerun_gives_every_row_once_with_the_same_text(tmp_path, model_dir):
    # Half the rows greedy, half sampled (a per-row temperature), prompts of different lengths.
    rows = [{"prompt": f"Batch row {i}: " + "the quick brown fox " * (i % 6), "temperature": 0.0 if i % 2 else 0.8}
            for i in range(ROWS)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", model_dir, "--input", src, "--max-tokens", 8, "--seed", 7, "--part-rows", 5,
              "--part-seconds", 0.3, "--max-num-seqs", 16, "--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress",
              *(["--dtype", DTYPE] if DTYPE else [])]

    ref = tmp_path / "ref"
    t0 = time.monotonic()
    proc = start([*common, "--output", ref])
    first_part = None
    while proc.poll() is None:
        if first_part is None and committed(ref) > 0:
            first_part = time.monotonic() - t0
        time.sleep(0.02)
    assert proc.returncode == 0, proc.stderr.read()
    startup = first_part or (time.monotonic() - t0)

    # Kill, rerun, kill again until the job finishes. On a fast machine a run can finish before its kill
    # comes; then that output is checked and a fresh one started, until KILLS kills have happened.
    rng = random.Random(SEED)
    kills, runs, moments, outputs = 0, 0, [], []
    while kills < KILLS:
        out = tmp_path / f"out{len(outputs)}"
        outputs.append(out)
        while True:
            runs += 1
            assert runs <= 3 * KILLS + 20, f"the job makes no progress between kills: {moments}"
            proc = start([*common, "--output", out])
            t0 = time.monotonic()
            if kills < KILLS:
                before = max(committed(out), 0)
                if rng.random() < 0.3:  # early: while starting up, opening the folder, the first steps
                    deadline, target = t0 + rng.uniform(0.0, 1.2 * startup), None
                else:  # after a random amount of progress, then a random instant: mid-step, mid-commit
                    target = before + rng.randint(1, max(1, (ROWS - before) // (2 * (KILLS - kills + 1))))
                    deadline = None
                while proc.poll() is None:
                    now = time.monotonic()
                    if deadline is None and committed(out) >= target:
                        deadline = now + rng.uniform(0.0, 0.3)
                    if deadline is not None and now >= deadline:
                        proc.kill()
                        if proc.wait() == -9:  # (not when it had just finished on its own)
                            kills += 1
                            moments.append((len(outputs) - 1, round(now - t0, 2), committed(out)))
                        break
                    time.sleep(0.01)
                if proc.returncode == -9:
                    assert not lock_holder(out).held  # a killed writer leaves no lock behind
                    continue
            proc.wait(timeout=600)
            assert proc.returncode == 0, proc.stderr.read()
            if committed(out) == ROWS:
                break
    assert kills >= KILLS, moments

    expected = export(ref, tmp_path / "ref.parquet")
    for n, out in enumerate(outputs):
        got = export(out, tmp_path / f"out{n}.parquet")
        assert [r["row_index"] for r in got] == list(range(ROWS))  # every input row exactly once
        differ = [r["row_index"] for r, e in zip(got, expected) if r != e]
        assert not differ, (f"{len(differ)} rows of output {n} differ from the uninterrupted run after the kills "
                            f"{[m for m in moments if m[0] == n]} (greedy: {[i for i in differ if i % 2]}, "
                            f"sampled: {[i for i in differ if not i % 2]})")
