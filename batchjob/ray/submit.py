"""`batchjob ray submit`, the driver: a job's shards on a Ray cluster people already have (docs/guide/ray.md). We
schedule our shards on Ray; Ray does not see rows. Each shard is `batchjob run JOB --shard K/N` writing
OUTPUT/shard-K-of-N/ and resuming from its manifest, run by a long-lived actor per shard slot that keeps its model
loaded, or as a Ray task of its own (runners.py). Ray retries a shard whose worker or node dies or whose run fails;
the retry resumes where the shard's last commit left it, so no row is done twice in the output. The driver follows
progress from the shards' manifests (not through Ray's object store), skips shards already finished (a driver killed
and run again continues), and on Ctrl-C or SIGTERM has the running shards drain and commit, as SIGTERM does for
`run`."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from batchjob.sharding.shard_progress import ShardProgress
from batchjob.sharding.sharded_output import has_job_file, sharded_status
from batchjob.errors import ConfigError
from batchjob.io.disk import disk
from batchjob.ray.runners import Runner, make_runner, shard_slots
from batchjob.launch.driver import PROGRESS_EVERY_S, drive, finished_shards, planned_shards
from batchjob.launch.shard_worker import STOP_FILE, ShardCall, ShardOutcome
from batchjob.ray.worker import sees_file



class RayUnavailable(ConfigError):
    """Ray is not installed, or its cluster cannot be reached."""


@dataclass(frozen=True, slots=True)
class RayOptions:
    shards: int | None  # None: four per GPU of the cluster, or per shard slot of its CPUs (stragglers balance)
    address: str | None = None  # as ray.init takes it: "auto", "ray://host:10001", "host:6379"; None: a local Ray
    cpus_per_shard: int = 1
    gpus_per_shard: float = 0
    max_retries: int = 3
    runner: Runner = Runner.ACTORS
    output: str | None = None  # --output: over the job file's (every shard is told it), as for `batchjob run`


@dataclass(slots=True)
class Submission:
    """What a submission ended with: every shard's outcome and the whole job's totals (from the manifests)."""
    outcomes: list[ShardOutcome]
    wall_s: float
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def line(self, state: str, output: Path) -> str:
        """The final line, in the form of `batchjob run`'s."""
        tps = self.completion_tokens / self.wall_s if self.wall_s else 0.0
        return (f"batchjob: {state}: {self.rows:,} rows ({self.errors:,} errors) in all; {len(self.outcomes)} shards, "
                f"{self.prompt_tokens} prompt tokens, {self.completion_tokens} generated tokens in {self.wall_s:.1f}s "
                f"({tps:.1f} tokens/s) -> {output}")


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("ray is not installed: in the batchjob checkout, .venv/bin/pip install -e '.[ray]' "
                             "(the Ray version batchjob is tested with)") from None
    return ray


CLIENT_ATTEMPTS = 3  # a Ray Client server that failed to start this client's session is asked again, twice


def connect(ray, address: str | None, log=print) -> None:
    """ray.init: a Ray of our own when `address` is None ("local", even where another was started on this machine),
    else the cluster at `address`. Through the Ray Client (ray://) the cluster's proxy starts a server for each
    driver, and that start fails now and then on a busy head node ("Initialization failure from server": the
    server process exits at once, with an empty log); that failure is retried after 2 s, then 4 s, and said.
    Any other failure is RayUnavailable at once."""
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            # Ray's own log lines (token authentication, "Started a local Ray instance") are not the operator's:
            # only its errors show, so our lines come first; the workers' output stays in their logs
            ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR, **({} if address else {"num_cpus": os.cpu_count()}))
            return
        except Exception as e:  # noqa: BLE001 - ray raises ConnectionError, RuntimeError, ... for a cluster not there
            transient = (isinstance(e, ConnectionAbortedError) and (address or "").startswith("ray://")
                         and "Initialization failure from server" in str(e))
            if not transient or attempt == CLIENT_ATTEMPTS:
                raise RayUnavailable(f"Ray cluster {address or '(local)'}: {type(e).__name__}: {e}") from None
            log(f"batchjob: Ray cluster {address}: its client server did not start this session "
                f"(attempt {attempt} of {CLIENT_ATTEMPTS}); connecting again in {2 ** attempt} s")
            ray.shutdown()
            time.sleep(2 ** attempt)


def submit_and_wait(job_file: Path, output: str, opts: RayOptions, log=print) -> Submission:
    """Run every unfinished shard on Ray and wait for all of them (a shard that failed after its retries has an exit
    code of 1 and its error). `output` as the job gives it (a Path would fold an URL's `//`)."""
    if "://" in output:
        raise ConfigError(f"output {output}: object-store URLs (s3://, gs://, ...) are not supported; give a folder "
                          "every node sees (NFS, Lustre, a shared volume)")
    output = Path(output)
    ray = import_ray()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.perf_counter()
    connect(ray, opts.address, log)
    try:
        outcomes = _run(ray, job_file, output, opts, log)
    finally:
        ray.shutdown()
    done = Submission(outcomes, time.perf_counter() - t0)
    if has_job_file(output):
        st = sharded_status(output, slurm=False)
        done.rows, done.errors = st["rows_done"], st["errors"]
        done.prompt_tokens, done.completion_tokens = st["prompt_tokens"], st["completion_tokens"]
    return done


def check_shared(ray, output: Path) -> None:
    """A file the driver writes in the output folder must be there on every node (its shards write and resume
    there): ConfigError naming the first node that does not see it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    disk().mkdir(output)
    probe = output / f".ray-probe-{os.getpid()}"
    token = f"{os.getpid()}-{time.time()}"
    disk().write_atomic(probe, token.encode())
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
        disk().remove(probe)


def _run(ray, job_file: Path, output: Path, opts: RayOptions, log) -> list[ShardOutcome]:
    slots = shard_slots(ray.cluster_resources(), opts.cpus_per_shard, opts.gpus_per_shard)
    count = opts.shards or planned_shards(output) or 4 * slots  # four per slot: stragglers balance
    done = finished_shards(output, count)
    todo = [k for k in range(count) if k not in done]
    outcomes = [ShardOutcome(k, 0) for k in sorted(done)]
    log(f"batchjob: {job_file} as {count} shards on Ray ({opts.address or 'local'}, {opts.runner.value}, "
        f"{min(slots, len(todo))} at a time) -> {output}" + (f"; {len(done)} already finished" if done else ""))
    if not todo:
        return outcomes
    if opts.address:  # a local Ray is this machine: its one filesystem
        check_shared(ray, output)
    stop_file = output.resolve() / STOP_FILE
    disk().remove(stop_file)  # an earlier driver's stop, done with
    call = ShardCall(str(job_file.resolve()), count, max(1, opts.cpus_per_shard), os.getcwd(), str(stop_file),
                     None if opts.output is None else str(output.resolve()))
    progress = ShardProgress(output, log_every=PROGRESS_EVERY_S)
    runner = make_runner(opts.runner, ray, call, cpus=opts.cpus_per_shard, gpus=opts.gpus_per_shard,
                         max_retries=opts.max_retries, slots=min(slots, len(todo)), log=progress.say)
    # Ctrl-C and SIGTERM handlers set after ray.init, which installs its own
    outcomes += drive(runner, todo, progress, stop_file)
    return sorted(outcomes, key=lambda o: o.index)
