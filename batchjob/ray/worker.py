"""What runs on a Ray worker for `batchjob ray submit` (the driver's side: runners.py, submit.py). A shard is
`batchjob run JOB --shard K/N` into OUTPUT/shard-K-of-N/, resuming from its manifest, in one of two ways:

- ShardWorker (launch/shard_worker.py), a long-lived actor per shard slot (a GPU, or `--cpus-per-shard` CPUs): it
  runs the shards the driver hands it one after another in its own process, through the same Job as `batchjob run`,
  and keeps the model loaded between them (job/process/kept_models.py). The default: measured, it saves a model load per
  shard (docs/guide/ray.md).
- run_shard, the body of one Ray task per shard: `batchjob run` as a child process that dies with the task's worker.

Either way, a shard whose run fails raises (and one whose process dies ends in Ray's error), and it is tried again,
by Ray for a task and by the driver for an actor (runners.py); the retry resumes where the shard's last commit left
it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from batchjob.errors import EXIT_RESUMABLE
from batchjob.launch.shard_worker import STOP_POLL_S, ShardCall, ShardFailed, ShardOutcome, die_with_parent


def run_shard(call: ShardCall, index: int) -> ShardOutcome:
    """The body of a Ray task per shard: the shard's `batchjob run` (this worker's Python: a node's may differ from
    the driver's) as a child that dies with this worker (PR_SET_PDEATHSIG), so a retry never meets an orphan holding
    the shard's lock. When the driver's stop file appears (or ray.cancel reaches this task) the child gets SIGTERM,
    drains and commits (exit 75). Raises on a failed shard so that Ray retries it."""
    proc = subprocess.Popen([sys.executable, "-m", "batchjob", *call.run_args(index)],
                            cwd=call.cwd if os.path.isdir(call.cwd) else None, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    err, told = "", False
    while True:
        try:
            err = proc.communicate(timeout=STOP_POLL_S)[1]
            break
        except subprocess.TimeoutExpired:
            stop = os.path.exists(call.stop_file)
        except KeyboardInterrupt:  # ray.cancel reached this task: drain as for the stop file
            stop = True
        if stop and not told:
            proc.send_signal(signal.SIGTERM)
            told = True
    if proc.returncode in (0, EXIT_RESUMABLE):
        return ShardOutcome(index, proc.returncode)
    tail = " | ".join(line for line in (err or "").strip().splitlines()[-3:] if line.strip())
    raise ShardFailed(f"shard {index}: batchjob run exited with {proc.returncode}: {tail[-800:]}")


def sees_file(path: str, token: str) -> bool:
    """On a node: whether the driver's probe file is there with its content."""
    try:
        return Path(path).read_text() == token
    except OSError:
        return False
