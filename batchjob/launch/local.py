"""Data parallel on this node (`batchjob run JOB --data-parallel N`): N rank processes, each pinned to its device (a
GPU through CUDA_VISIBLE_DEVICES, or its own set of cores, inside one NUMA node where the machine has several), on
one output folder. The job is cut into shards (four per rank, so a fast rank takes more); the driver hands each idle
rank the next shard, and a rank runs it through the same Job as `batchjob run --shard K/N` with its model kept
loaded between shards (shard_worker.py). A rank that dies (SIGKILL, out of memory) is started again in its place and
its shard redone from the shard's last commit; a killed driver takes its ranks with it (PR_SET_PDEATHSIG) and a
rerun of the same command continues. Rows are batch-invariant, so the text is the single process's."""
from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from batchjob.sharding.shard_progress import ShardProgress
from batchjob.sharding.sharded_output import has_job_file, sharded_status
from batchjob.errors import EXIT_RESUMABLE, ConfigError
from batchjob.io.disk import disk
from batchjob.sharding.shards import plan_shards
from batchjob.io.manifest import MANIFEST
from batchjob.io.sources import open_source
from batchjob.job.inputs import input_folders
from batchjob.job.report.summary import JobSummary
from batchjob.launch.driver import PROGRESS_EVERY_S, Retries, drive, finished_shards, planned_shards
from batchjob.engine.placement import Placement, die_with_parent, gpu_count, place, visible_gpu
from batchjob.launch.shard_worker import STOP_FILE, ShardCall, ShardFailed, ShardOutcome, ShardWorker

SHARDS_PER_RANK = 4  # stragglers balance: a rank that finishes early takes another shard
MAX_RETRIES = 3  # a shard whose rank died or whose run failed is tried again this many times, from its last commit
LOG_DIR = "data-parallel"  # OUTPUT/data-parallel/rank-R.log: each rank's own lines


def rank_count(value: str | int | None) -> int | str | None:
    """`--data-parallel`: None or 1 (one process), N >= 1, or 'auto'."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"data_parallel: expected a number of ranks >= 1 or 'auto', got {value!r}")
    return int(text)


def wants_ranks(value: str | int | None) -> bool:
    """Whether `--data-parallel` asks for rank processes (unset and 1 run the job in this process)."""
    return rank_count(value) not in (None, 1)


# ---- the ranks ------------------------------------------------------------------------------------


def _rank_main(conn, call: ShardCall, placement: Placement, log_path: str) -> None:
    """A rank's process (spawned: nothing of the driver's torch state comes with it): pinned to its device before
    torch is imported, its lines in its log, then the shards the driver sends until it sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the driver, which stops the ranks
    die_with_parent()
    if placement.gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(placement.gpu)
    if placement.cpus:
        os.sched_setaffinity(0, placement.cpus)  # first-touch memory then comes from the cores' NUMA node
    fd = disk().open(Path(log_path), append=True)  # the rank's stdout and stderr: its own log
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    worker = ShardWorker(call)
    while True:
        try:
            index = conn.recv()
        except EOFError:  # the driver is gone
            return
        if index is None:
            return
        print(f"batchjob: rank {placement.rank} ({placement.describe()}): shard {index}/{call.count}", flush=True)
        try:
            outcome = worker.run(index)
        except ShardFailed as e:
            outcome = ShardOutcome(index, 1, str(e))
        conn.send(outcome)


def _how(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"


@dataclass(slots=True)
class _Rank:
    placement: Placement
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    shard: int | None = None  # the shard it runs


class LocalRanks:
    """The ShardRunner of a data-parallel run: one process per Placement. The driver hands an idle rank the next
    shard; a shard that failed, or whose rank died (a new rank takes the dead one's place), goes back to the front
    of the queue, up to MAX_RETRIES times, and resumes from its last commit."""

    def __init__(self, call: ShardCall, placements: list[Placement], log_dir: Path, log,
                 threads: int | None = None) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.call, self.log_dir, self.log, self.threads = call, log_dir, log, threads
        self.ranks = [self._start(p) for p in placements]
        self.idle = list(reversed(self.ranks))  # rank 0 is handed a shard first
        self.queue: deque[int] = deque()
        self.retries = Retries(MAX_RETRIES, log, "rank")

    def _start(self, placement: Placement) -> _Rank:
        ours, theirs = self.ctx.Pipe()
        call = dataclasses.replace(self.call, threads=self.threads or len(placement.cpus))  # its cores, or --threads
        process = self.ctx.Process(target=_rank_main, name=f"batchjob-rank-{placement.rank}", daemon=True,
                                   args=(theirs, call, placement, str(self.log_dir / f"rank-{placement.rank}.log")))
        process.start()
        theirs.close()
        return _Rank(placement, process, ours)

    def submit(self, shards: list[int]) -> None:
        self.queue.extend(shards)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.idle and self.queue:
            rank, k = self.idle.pop(), self.queue.popleft()
            try:
                rank.conn.send(k)
            except OSError:  # it died between shards: a new rank takes its place and the shard
                rank.process.join(1)
                self.log(f"batchjob: rank {rank.placement.rank} died ({_how(rank.process.exitcode)}) between shards; "
                         "a new rank takes its place")
                rank = self._replace(rank)
                rank.conn.send(k)
            rank.shard = k

    def _running(self) -> list[_Rank]:
        return [r for r in self.ranks if r.shard is not None]

    def _ended(self, timeout: float) -> list[tuple[_Rank, ShardOutcome]]:
        running = self._running()
        if not running:
            return []
        waits = {r.conn: r for r in running} | {r.process.sentinel: r for r in running}
        ready = multiprocessing.connection.wait(list(waits), timeout)
        ended: dict[int, tuple[_Rank, ShardOutcome]] = {}
        for handle in ready:
            rank = waits[handle]
            if id(rank) in ended:
                continue
            outcome = None
            if rank.conn.poll():
                try:
                    outcome = rank.conn.recv()
                except (EOFError, OSError):
                    outcome = None
            if outcome is None:
                if rank.process.is_alive() and handle is rank.conn:
                    continue
                rank.process.join(1)
                outcome = ShardOutcome(rank.shard, 1, f"rank {rank.placement.rank} died "
                                       f"({_how(rank.process.exitcode)})", worker_lost=True)
            ended[id(rank)] = (rank, outcome)
        return list(ended.values())

    def poll(self, timeout: float) -> list[ShardOutcome]:
        done = []
        for rank, result in self._ended(timeout):
            rank.shard = None
            if result.worker_lost:
                rank = self._replace(rank)
            final = self.retries.settle(result, self.queue)
            if final is not None:
                done.append(final)
            self.idle.append(rank)
        self._dispatch()
        return done

    def _replace(self, dead: _Rank) -> _Rank:
        fresh = self._start(dead.placement)
        self.ranks[self.ranks.index(dead)] = fresh
        return fresh

    @property
    def busy(self) -> bool:
        return bool(self.queue or self._running())

    def stop(self) -> list[ShardOutcome]:
        ended = [ShardOutcome(k, EXIT_RESUMABLE) for k in self.queue]  # never started
        self.queue.clear()
        while self._running():  # they drain on the stop file
            for rank, result in self._ended(1.0):
                rank.shard = None
                ended.append(result)
        return ended

    def close(self) -> None:
        for rank in self.ranks:
            try:
                rank.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for rank in self.ranks:
            rank.process.join(max(0.0, deadline - time.monotonic()))
            if rank.process.is_alive():
                rank.process.kill()


# ---- the driver -----------------------------------------------------------------------------------


@dataclass(slots=True)
class DataParallelRun:
    """What a data-parallel run ended with: each shard's outcome and the whole job's totals (from the manifests)."""
    outcomes: list[ShardOutcome]
    placements: list[Placement]
    wall_s: float
    status: dict

    @property
    def failed(self) -> list[ShardOutcome]:
        return [o for o in self.outcomes if o.exit_code not in (0, EXIT_RESUMABLE)]

    @property
    def stopped(self) -> bool:
        return any(o.exit_code == EXIT_RESUMABLE for o in self.outcomes)


def run_data_parallel(job_file: str | None, options: dict, cfg, *, restart: bool = False, log=print) -> DataParallelRun:
    """The job (`job_file` and `options`, as `run` took them; `cfg` the JobConfig they make) on this node's devices,
    one rank per Placement."""
    ranks = rank_count(cfg.data_parallel)
    if restart:
        raise ConfigError("--restart with --data-parallel: remove the output folder instead (its shards are several "
                          "folders)")
    if cfg.shard not in (None, "none"):
        raise ConfigError("--data-parallel with --shard: a data-parallel run shards the job itself; run each shard "
                          "without --data-parallel, or the whole job with it")
    if cfg.per_lane_inputs:
        raise ConfigError("--data-parallel: lanes with their own inputs cannot be sharded; run each lane's input as "
                          "its own job")
    if cfg.limit is not None:
        raise ConfigError("--limit with --data-parallel: try the first rows without --data-parallel, then run the "
                          "whole job with it into another --output")
    if cfg.tensor_parallel > 1:  # each rank would need a group of devices (GPUs, or cores) of its own: not placed so yet
        raise ConfigError("--data-parallel with --tensor-parallel is not implemented yet; run --tensor-parallel N alone "
                          "(one model split over N devices), or --data-parallel N alone (a whole model per device)")
    output = Path(cfg.output)
    if (output / MANIFEST).exists() and not has_job_file(output):
        raise ConfigError(f"{output} holds an unsharded run; a data-parallel run writes shards: rerun it without "
                          "--data-parallel, or give another --output")
    (path, _, _), = input_folders(cfg, output)
    device = cfg.device.value if cfg.device is not None else "auto"  # unset: cuda when there is one
    placements = place(ranks, device, gpu_count(device), set(os.sched_getaffinity(0)))
    planned = planned_shards(output)
    count = planned or SHARDS_PER_RANK * len(placements)
    if planned is None:  # an input that cannot be cut (compressed JSONL, CSV) is said once here, not by every rank
        plan_shards(open_source(path, input_format=cfg.input_format), count)
    done = finished_shards(output, count)  # count is the planned one when there is a plan
    todo = [k for k in range(count) if k not in done]
    t0 = time.perf_counter()
    log(f"batchjob: data parallel: {len(placements)} ranks ({'; '.join(p.describe() for p in placements)}), "
        f"{count} shards -> {output}" + (f"; {len(done)} already finished" if done else ""))
    outcomes = [ShardOutcome(k, 0) for k in sorted(done)]
    if todo:
        disk().mkdir(output)
        log_dir = output / LOG_DIR
        disk().mkdir(log_dir)
        stop_file = output.resolve() / STOP_FILE
        disk().remove(stop_file)  # an earlier driver's stop, done with
        call = ShardCall(None if job_file is None else str(Path(job_file).resolve()), count, 1, os.getcwd(),
                         str(stop_file), options={**options, "output": str(output.resolve())})
        runner = LocalRanks(call, placements, log_dir, log, threads=cfg.threads)
        try:
            outcomes += drive(runner, todo, ShardProgress(output, log_every=PROGRESS_EVERY_S), stop_file)
        finally:
            runner.close()
    status = sharded_status(output, slurm=False) if has_job_file(output) else {}
    return DataParallelRun(sorted(outcomes, key=lambda o: o.index), placements, time.perf_counter() - t0, status)


class DataParallelFailed(RuntimeError):
    """A shard of a data-parallel run failed after its retries (the API's run(); the command line says it and exits
    with 1)."""


def data_parallel_summary(done: DataParallelRun, cfg) -> JobSummary:
    """The run as the API's run() returns a job's: the whole job's rows and tokens (from the manifests)."""
    if done.failed:
        raise DataParallelFailed("; ".join(f"shard {o.index}: {o.error}" for o in done.failed))
    st = done.status
    return JobSummary(rows=st.get("rows_done", 0), errors=st.get("errors", 0), prompt_tokens=st.get("prompt_tokens", 0),
                      generated_tokens=st.get("completion_tokens", 0), wall_s=done.wall_s, output=str(cfg.output),
                      stopped="a signal" if done.stopped else None, total_rows=st.get("total_rows"))
