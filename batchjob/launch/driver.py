"""The driver's loop over a sharded job's shards, whoever runs them (Ray's actors or tasks: ray/runners.py; this
node's data-parallel ranks: local.py): the runner is handed the unfinished shards, the driver follows progress from
the shards' manifests (one bar, or a line every so often), and on Ctrl-C or SIGTERM writes the stop file in the
output folder: the running shards drain and commit, as SIGTERM does for `run`."""
from __future__ import annotations

import os
import signal
import threading
from collections import deque
from pathlib import Path
from typing import Protocol

from batchjob.sharding.shard_progress import ShardProgress
from batchjob.sharding.sharded_output import has_job_file, shard_states
from batchjob.sharding.shards import JobFile
from batchjob.errors import ConfigError
from batchjob.io.disk import disk
from batchjob.launch.shard_worker import ShardOutcome

PROGRESS_EVERY_S = 30.0  # a plain progress line's period (a terminal's bar moves every second)
POLL_S = 0.5


class ShardRunner(Protocol):
    def submit(self, shards: list[int]) -> None:
        """Queue these shards."""

    def poll(self, timeout: float) -> list[ShardOutcome]:
        """The shards that ended within `timeout` seconds (those that failed: after their retries)."""

    @property
    def busy(self) -> bool:
        """Whether a submitted shard has not ended."""

    def stop(self) -> list[ShardOutcome]:
        """After the driver's stop file is written: the shards not started end at once (EXIT_RESUMABLE), the running
        ones drain and commit; the outcomes of every shard that had not ended."""


class Retries:
    """A runner's retries: a shard that failed (its run raised, or its process died) goes back to the front of the
    queue, up to `most` times, and resumes from its last commit; after that its outcome is final."""

    def __init__(self, most: int, log, worker: str) -> None:
        self.most, self.log, self.worker = most, log, worker  # worker: what runs a shard ("actor", "rank")
        self.failures: dict[int, int] = {}  # shard -> times it failed

    def settle(self, result: ShardOutcome, queue: deque[int]) -> ShardOutcome | None:
        """The shard's final outcome, or None when it went back to the queue."""
        k, tries = result.index, self.failures.get(result.index, 0)
        if result.exit_code != 1 or tries >= self.most:
            return result
        self.failures[k] = tries + 1
        self.log(f"batchjob: shard {k} failed (try {tries + 1} of {self.most + 1}), retrying from its last commit"
                 f"{f' on a new {self.worker}' if result.worker_lost else ''}: {result.error}")
        queue.appendleft(k)
        return None


def drive(runner: ShardRunner, todo: list[int], progress: ShardProgress, stop_file: Path) -> list[ShardOutcome]:
    """Run `todo` on `runner` until every shard has ended, or until Ctrl-C / SIGTERM: then the stop file is written
    and the running shards drain. The outcomes of the shards in `todo`."""
    outcomes: list[ShardOutcome] = []
    runner.submit(todo)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while runner.busy and not stopping.is_set():
            outcomes += runner.poll(POLL_S)
            progress.tick()
        if runner.busy:
            progress.say("batchjob: stopping: the running shards drain and commit (as SIGTERM does for `run`)")
            disk().write_atomic(stop_file, f"stopped by the driver, pid {os.getpid()}\n".encode())
            outcomes += runner.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        progress.close()
    return outcomes


def planned_shards(output: Path) -> int | None:
    """The shard count an earlier run of this output planned (OUT/job.json), or None."""
    job = JobFile.load(output)
    return job.shards if job is not None else None


def finished_shards(output: Path, count: int) -> set[int]:
    """The shards of an earlier run whose rows are all committed (none when the folder is not a job of `count`
    shards yet)."""
    if not has_job_file(output):
        return set()
    job, states = shard_states(output)
    if job.shards != count:
        raise ConfigError(f"{output} holds a job of {job.shards} shards; run it with --shards {job.shards}")
    return {s.index for s in states if s.complete}
