"""A shard run in a long-lived process that keeps its model loaded between shards: what a Ray actor
(ray/runners.py) and a data-parallel rank on this node (launch/local.py) both host. A shard is `batchjob run JOB
--shard K/N` into OUTPUT/shard-K-of-N/, through the same Job, resuming from its manifest. When the driver stops
(Ctrl-C, SIGTERM) it writes STOP_FILE in the shared output folder: running shards drain and commit, as SIGTERM does
for `run`, and end with EXIT_RESUMABLE."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field

from batchjob.engine.placement import die_with_parent  # noqa: F401 - ray/worker.py's too
from batchjob.errors import EXIT_RESUMABLE

STOP_FILE = ".driver-stop"  # written in the output folder by a stopping driver (Ray's, data parallel's): shards drain
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
    job_file: str | None  # absolute; None: the job is `options` alone (flags without a file)
    count: int  # N
    threads: int  # the shard's torch threads: --cpus-per-shard
    cwd: str  # the driver's: relative paths in the job file are taken from it (where a worker has that folder)
    stop_file: str
    output: str | None = None  # `ray submit --output`: over the job file's, as `run --output` is
    options: dict = field(default_factory=dict)  # `run`'s flags (a data-parallel run's): over the job file's

    def overrides(self, index: int) -> dict:
        """The options shard `index` runs with over the job file's (as flags: run_args)."""
        given = {**self.options, "shard": f"{index}/{self.count}", "threads": self.threads, "progress": False,
                 "data_parallel": "1"}
        return given if self.output is None else {**given, "output": self.output}

    def run_args(self, index: int) -> list[str]:
        """`batchjob run`'s arguments for shard `index` (a call without `options`: Ray's tasks)."""
        assert not self.options, "run_args: the flags of a data-parallel run are not passed as arguments"
        output = [] if self.output is None else ["--output", self.output]
        return ["run", self.job_file, "--shard", f"{index}/{self.count}", "--threads", str(self.threads),
                "--no-progress", *output]


class ShardWorker:
    """A Ray actor that runs shards in its own process, keeping the model loaded between them (one job's shards
    share it). Its methods run on the worker's main thread, where the model loads and computes (one thread owns the
    OpenMP team: job/process/threads.py)."""

    def __init__(self, call: ShardCall) -> None:
        from batchjob.job.process.threads import choose_wait_policy

        choose_wait_policy()  # before torch is imported, as `batchjob run` does
        if os.path.isdir(call.cwd):
            os.chdir(call.cwd)
        self.call = call
        self.keeper = None  # a ModelKeeper from the first shard on (torch is imported then)

    def run(self, index: int) -> ShardOutcome:
        """Shard `index` through the same Job as `batchjob run JOB --shard K/N`; raises ShardFailed when the run
        fails (the driver then hands the shard out again: runners.py ActorRunner)."""
        from batchjob.job.options.config import load_job
        from batchjob.job.process.kept_models import ModelKeeper
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
    from batchjob.job.process.failures import job_failures

    return isinstance(e, (ConfigError, *job_failures()))

