"""What runs on a Ray worker for `batchjob ray submit` (the driver's side: runners.py, submit.py). A shard is
`batchjob run JOB --shard K/N` into OUTPUT/shard-K-of-N/, resuming from its manifest, in one of two ways:

- ShardWorker, a long-lived actor per shard slot (a GPU, or `--cpus-per-shard` CPUs): it runs the shards the driver
  hands it one after another in its own process, through the same Job as `batchjob run`, and keeps the model loaded
  between them (job/kept_models.py). The default: measured, it saves a model load per shard (docs/guide/ray.md).
- run_shard, the body of one Ray task per shard: `batchjob run` as a child process that dies with the task's worker.

Either way, a shard whose run fails raises (and one whose process dies ends in Ray's error), and it is tried again,
by Ray for a task and by the driver for an actor (runners.py); the retry resumes where the shard's last commit left
it. When the driver stops (Ctrl-C, SIGTERM) it writes STOP_FILE in the shared output
folder: running shards drain and commit, as SIGTERM does for `run`, and end with EXIT_RESUMABLE."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from batchjob.errors import EXIT_RESUMABLE

STOP_FILE = ".ray-stop"  # written in the output folder by a stopping driver: the running shards drain
STOP_POLL_S = 0.5


@dataclass(slots=True)
class ShardOutcome:
    index: int
    exit_code: int  # 0 finished, EXIT_RESUMABLE drained (or never started) on a stop, 1 failed (after its retries)
    error: str | None = None  # why it failed
    worker_lost: bool = False  # it failed because the actor running it was lost (its process or node died)


class ShardFailed(RuntimeError):
    """A shard's run ended in an error (Ray retries the shard; the last one is the driver's message)."""


@dataclass(frozen=True, slots=True)
class ShardCall:
    """What every shard of one submission is run with (sent to the workers)."""
    job_file: str  # absolute
    count: int  # N
    threads: int  # the shard's torch threads: --cpus-per-shard
    cwd: str  # the driver's: relative paths in the job file are taken from it (where a worker has that folder)
    stop_file: str
    output: str | None = None  # `ray submit --output`: over the job file's, as `run --output` is

    def overrides(self, index: int) -> dict:
        """The options shard `index` runs with over the job file's (as flags: run_args)."""
        given = {"shard": f"{index}/{self.count}", "threads": self.threads, "progress": False}
        return given if self.output is None else {**given, "output": self.output}

    def run_args(self, index: int) -> list[str]:
        """`batchjob run`'s arguments for shard `index`."""
        output = [] if self.output is None else ["--output", self.output]
        return ["run", self.job_file, "--shard", f"{index}/{self.count}", "--threads", str(self.threads),
                "--no-progress", *output]


class ShardWorker:
    """A Ray actor that runs shards in its own process, keeping the model loaded between them (one job's shards
    share it). Its methods run on the worker's main thread, where the model loads and computes (one thread owns the
    OpenMP team: job/threads.py)."""

    def __init__(self, call: ShardCall) -> None:
        from batchjob.job.threads import choose_wait_policy

        choose_wait_policy()  # before torch is imported, as `batchjob run` does
        if os.path.isdir(call.cwd):
            os.chdir(call.cwd)
        self.call = call
        self.keeper = None  # a ModelKeeper from the first shard on (torch is imported then)

    def run(self, index: int) -> ShardOutcome:
        """Shard `index` through the same Job as `batchjob run JOB --shard K/N`; raises ShardFailed when the run
        fails (the driver then hands the shard out again: runners.py ActorRunner)."""
        from batchjob.job.config import load_job
        from batchjob.job.kept_models import ModelKeeper
        from batchjob.job.run import Job

        call = self.call
        if os.path.exists(call.stop_file):  # the driver stopped before this shard began
            return ShardOutcome(index, EXIT_RESUMABLE)
        self.keeper = self.keeper or ModelKeeper()
        done = threading.Event()
        try:
            cfg = load_job(call.job_file, call.overrides(index))
            with contextlib.ExitStack() as held:  # the shard's output lock goes back however it ends
                job = Job(cfg, resources=held, keeper=self.keeper)
                threading.Thread(target=_stop_on_file, args=(call.stop_file, job.stop, done), daemon=True).start()
                summary = job.run()
        except Exception as e:  # noqa: BLE001 - every failure is the shard's: Ray retries it, the driver names it
            raise ShardFailed(f"shard {index}: {type(e).__name__}: {e}" if not _expected(e) else
                              f"shard {index}: {e}") from None
        finally:
            done.set()
        print(summary.line(), file=sys.stderr, flush=True)  # the worker's log
        return ShardOutcome(index, EXIT_RESUMABLE if summary.stopped else 0)


def _stop_on_file(stop_file: str, stop, done: threading.Event) -> None:
    """Until the shard ends: when the driver's stop file appears, the job drains as on a first SIGTERM."""
    while not done.wait(STOP_POLL_S):
        if os.path.exists(stop_file):
            stop.request("the driver's stop (Ctrl-C or SIGTERM)")
            return


def _expected(e: Exception) -> bool:
    """A failure `batchjob run` reports in one line (its message says it all)."""
    from batchjob.errors import ConfigError
    from batchjob.job.failures import job_failures

    return isinstance(e, (ConfigError, *job_failures()))


def run_shard(call: ShardCall, index: int) -> ShardOutcome:
    """The body of a Ray task per shard: the shard's `batchjob run` (this worker's Python: a node's may differ from
    the driver's) as a child that dies with this worker (PR_SET_PDEATHSIG), so a retry never meets an orphan holding
    the shard's lock. When the driver's stop file appears (or ray.cancel reaches this task) the child gets SIGTERM,
    drains and commits (exit 75). Raises on a failed shard so that Ray retries it."""
    proc = subprocess.Popen([sys.executable, "-m", "batchjob", *call.run_args(index)],
                            cwd=call.cwd if os.path.isdir(call.cwd) else None, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
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


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child may outlive a killed worker (its lock then waits for it)
        pass


def sees_file(path: str, token: str) -> bool:
    """On a node: whether the driver's probe file is there with its content."""
    try:
        return Path(path).read_text() == token
    except OSError:
        return False
