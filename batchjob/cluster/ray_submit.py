"""Ray: a job's shards run as Ray tasks on a cluster people already have (docs/guide/ray.md). We schedule our shards
on Ray; Ray does not see rows. Each shard is one task that runs `batchjob run JOB --shard K/N` as a child process
(the same code path as a plain or Slurm shard, in a fresh interpreter that dies with the task's worker), writing
OUTPUT/shard-K-of-N/ and resuming from its manifest. Ray retries a task whose worker or node dies (`max_retries`)
or whose shard exits with an error (`retry_exceptions`); the retry resumes where the shard's last commit left it,
so no row is done twice in the output. The driver follows progress from the shards' manifests (not through Ray's
object store), skips shards already finished (a driver killed and run again continues), and on Ctrl-C or SIGTERM
asks the running shards to drain and commit, as SIGTERM does for `run`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchjob.errors import EXIT_RESUMABLE, ConfigError

PROGRESS_EVERY_S = 30.0
STOP_FILE = ".ray-stop"  # written in the output folder by a stopping driver: the running shards drain


class RayUnavailable(ConfigError):
    """Ray is not installed, or its cluster cannot be reached."""


@dataclass(frozen=True, slots=True)
class RayOptions:
    shards: int | None  # None: four per GPU of the cluster, or per shard slot of its CPUs (stragglers balance)
    address: str | None = None  # as ray.init takes it: "auto", "ray://host:10001", "host:6379"; None: a local Ray
    cpus_per_shard: int = 1
    gpus_per_shard: float = 0
    max_retries: int = 3


@dataclass(slots=True)
class ShardOutcome:
    index: int
    exit_code: int
    error: str | None = None  # the shard's last stderr lines, when it failed


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("ray is not installed: pip install 'batchjob[ray]' (the version batchjob is tested "
                             "with)") from None
    return ray


def shard_args(job_file: Path, index: int, count: int, opts: RayOptions, overrides: list[str]) -> list[str]:
    """`batchjob run`'s arguments for one shard (the worker runs them with its own interpreter)."""
    return ["run", str(job_file.resolve()), "--shard", f"{index}/{count}", "--threads", str(max(1, opts.cpus_per_shard)),
            "--no-progress", *overrides]


def run_shard(args: list[str], cwd: str, index: int, stop_file: str) -> ShardOutcome:
    """The task's body, on a Ray worker: the shard's `batchjob run` (this worker's Python: a node's may differ from
    the driver's) as a child that dies with this worker (PR_SET_PDEATHSIG), so a retry never meets an orphan holding
    the shard's lock. When the driver stops, it writes `stop_file` in the (shared) output folder: the child gets
    SIGTERM, drains and commits (exit 75). Raises on a failed shard so that Ray retries it; returns its outcome when
    it finished or drained."""
    proc = subprocess.Popen([sys.executable, "-m", "batchjob", *args], cwd=cwd if os.path.isdir(cwd) else None,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    err, told = "", False
    while True:
        try:
            err = proc.communicate(timeout=0.5)[1]
            break
        except subprocess.TimeoutExpired:
            stop = os.path.exists(stop_file)
        except KeyboardInterrupt:  # ray.cancel reached this task: drain as for the stop file
            stop = True
        if stop and not told:
            proc.send_signal(signal.SIGTERM)
            told = True
    if proc.returncode in (0, EXIT_RESUMABLE):
        return ShardOutcome(index, proc.returncode)
    tail = " | ".join(line for line in (err or "").strip().splitlines()[-3:] if line.strip())
    raise RuntimeError(f"shard {index}: batchjob run exited with {proc.returncode}: {tail[-800:]}")


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the child may outlive a killed worker (its lock then waits for it)
        pass


def submit_and_wait(job_file: Path, output: Path, opts: RayOptions, overrides: list[str], log=print) -> list[ShardOutcome]:
    """Run every unfinished shard as a Ray task and wait for all of them; returns each shard's outcome (a shard
    that failed after its retries has an exit code of 1 and its error)."""
    ray = import_ray()
    if str(output).startswith(("s3://", "gs://", "az://")):
        raise ConfigError(f"output {output}: object-store URLs are not supported; give a folder every node sees")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        # no address: a Ray of our own ("local"), even where another was started on this machine
        ray.init(address=opts.address or "local", include_dashboard=False, log_to_driver=False,
                 **({} if opts.address else {"num_cpus": os.cpu_count()}))
    except Exception as e:  # noqa: BLE001 - ray raises ConnectionError, RuntimeError, ... for a cluster not there
        raise RayUnavailable(f"Ray cluster {opts.address or '(local)'}: {type(e).__name__}: {e}") from None
    try:
        return _run(ray, job_file, output, opts, overrides, log)
    finally:
        ray.shutdown()


def check_shared(ray, output: Path) -> None:
    """A file the driver writes in the output folder must be there on every node (its shards write and resume
    there): ConfigError naming the first node that does not see it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    output.mkdir(parents=True, exist_ok=True)
    probe = output / f".ray-probe-{os.getpid()}"
    token = f"{os.getpid()}-{time.time()}"
    probe.write_text(token)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        sees = ray.remote(sees_file)
        refs = [sees.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(probe.resolve()), token) for n in nodes]
        for node, seen in zip(nodes, ray.get(refs)):
            if not seen:
                raise ConfigError(f"output {output}: not visible from the Ray node {node.get('NodeManagerAddress')} (a "
                                  "file the driver wrote there is missing on it); give a folder every node sees (NFS, "
                                  "Lustre, a shared volume)")
    finally:
        probe.unlink(missing_ok=True)


def sees_file(path: str, token: str) -> bool:
    """On a node: whether the driver's probe file is there with its content."""
    try:
        return Path(path).read_text() == token
    except OSError:
        return False


def default_shards(resources: dict, opts: RayOptions) -> int:
    """Four per GPU, or per shard slot of the CPUs, of the cluster: stragglers balance."""
    if opts.gpus_per_shard:
        return 4 * max(1, int(resources.get("GPU", 0) // opts.gpus_per_shard))
    return 4 * max(1, int(resources.get("CPU", 1) // max(1, opts.cpus_per_shard)))


def _run(ray, job_file: Path, output: Path, opts: RayOptions, overrides: list[str], log) -> list[ShardOutcome]:
    count = opts.shards or planned_shards(output) or default_shards(ray.cluster_resources(), opts)
    done = finished_shards(output, count)
    todo = [k for k in range(count) if k not in done]
    outcomes = [ShardOutcome(k, 0) for k in sorted(done)]
    log(f"batchjob: {job_file} as {count} shards on Ray ({opts.address or 'local'}) -> {output}"
        + (f"; {len(done)} already finished" if done else ""))
    if not todo:
        return outcomes
    if opts.address:  # a local Ray is this machine: its one filesystem
        check_shared(ray, output)
    task = ray.remote(run_shard).options(num_cpus=opts.cpus_per_shard, num_gpus=opts.gpus_per_shard,
                                         max_retries=opts.max_retries, retry_exceptions=True)
    cwd, stop_file = os.getcwd(), output.resolve() / STOP_FILE
    stop_file.unlink(missing_ok=True)  # an earlier driver's stop, done with
    refs = {task.remote(shard_args(job_file, k, count, opts, overrides), cwd, k, str(stop_file)): k for k in todo}
    pending, last = list(refs), 0.0
    stopping = threading.Event()  # Ctrl-C or SIGTERM (handlers set after ray.init, which installs its own)
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while pending and not stopping.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            for ref in ready:
                outcomes.append(_outcome(ray, ref, refs[ref]))
            if time.monotonic() - last >= PROGRESS_EVERY_S or not pending:
                last = time.monotonic()
                log(progress_line(output))
        if pending:
            log("batchjob: stopping: the running shards drain and commit (as SIGTERM does for `run`)")
            stop_file.write_text(f"stopped by the driver, pid {os.getpid()}\n")
            for ref in pending:  # a shard not started yet is cancelled; a running one drains (exit 75)
                ray.cancel(ref)
            outcomes += [_outcome(ray, ref, refs[ref]) for ref in pending]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return sorted(outcomes, key=lambda o: o.index)


def _outcome(ray, ref, index: int) -> ShardOutcome:
    try:
        return ray.get(ref)
    except ray.exceptions.TaskCancelledError:
        return ShardOutcome(index, EXIT_RESUMABLE)
    except ray.exceptions.RayError as e:
        cause = getattr(e, "cause", None)
        return ShardOutcome(index, 1, str(cause) if cause is not None else f"{type(e).__name__}: {e}")


def planned_shards(output: Path) -> int | None:
    """The shard count an earlier run of this output planned (OUT/job.json), or None."""
    from batchjob.cluster.shards import JobFile

    job = JobFile.load(output)
    return job.shards if job is not None else None


def finished_shards(output: Path, count: int) -> set[int]:
    """The shards of an earlier run whose rows are all committed (none when the folder is not a job of `count`
    shards yet)."""
    from batchjob.cluster.sharded_output import has_job_file, shard_states

    if not has_job_file(output):
        return set()
    job, states = shard_states(output)
    if job.shards != count:
        raise ConfigError(f"{output} holds a job of {job.shards} shards; run it with --shards {job.shards}")
    return {s.index for s in states if s.complete}


def progress_line(output: Path) -> str:
    from batchjob.cluster.sharded_output import ShardError, sharded_status

    try:
        st = sharded_status(output, slurm=False)
    except ShardError:
        return "batchjob: shards starting (no shard has planned the job yet)"
    total = f"{st['total_rows']:,}" if st["total_rows"] is not None else "?"
    running = sum(s["state"] == "running" for s in st["shard_states"])
    rate = f", {st['rows_per_s']:,.1f} rows/s" if st["rows_per_s"] else ""
    eta = f", ETA {st['eta_s'] / 60:.1f} min" if st["eta_s"] else ""
    return f"batchjob: {st['rows_done']:,} / {total} rows, {running} of {st['shards']} shards running{rate}{eta}"
