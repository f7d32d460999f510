"""Slurm: the sbatch script that runs a job as an array of shards, its submission, its tasks' states.

Each array task K runs `batchjob run JOB --shard K/N`. Slurm warns a task `grace` seconds before
its time limit (or on preemption, when the cluster sends the warning signal) with SIGUSR1 to the
batch shell; the shell forwards it, batchjob drains, commits and exits 75, and the task requeues
itself. Everything the task needs to resume is in its shard folder.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.io.manifest import utc_now
from batchjob.io.disk import File, disk
from batchjob.errors import EXIT_RESUMABLE, ConfigError  # what batchjob exits with after draining on a signal

SCRIPT = "batchjob.sbatch"
SUBMISSIONS = "submissions.jsonl"


class SlurmError(Exception):
    """sbatch is missing or refused the job; the message says what Slurm said."""


@dataclass(slots=True)
class SubmitOptions:
    shards: int
    partition: str | None = None
    gpus_per_task: int | None = None
    cpus_per_task: int | None = None
    time: str | None = None  # Slurm time format, e.g. 4:00:00 or 1-00:00:00
    mem: str | None = None  # e.g. 16G
    account: str | None = None
    grace: int = 120  # seconds between the warning signal and the time limit
    job_name: str | None = None
    sbatch_options: list[str] = field(default_factory=list)  # more `#SBATCH` lines, e.g. --qos=low


def slurm_folder(out: Path) -> Path:
    return out / "slurm"


def render_script(job_file: Path, output: Path, opts: SubmitOptions, *, python: str | None = None,
                  workdir: Path | None = None) -> str:
    """A readable sbatch script for `job_file` as an array of `opts.shards` shards into `output`."""
    python = python or sys.executable  # the venv's interpreter: the script runs this very batchjob
    workdir = (workdir or Path.cwd()).resolve()
    job_file, output = job_file.resolve(), output.resolve()
    n = opts.shards
    logs = slurm_folder(output) / "logs"
    directives = [
        f"--job-name={opts.job_name or 'batchjob-' + job_file.stem}",
        f"--array=0-{n - 1}",
        "--ntasks=1",
        f"--output={logs}/%A_%a.log",  # one log per task, kept across requeues:
        "--open-mode=append",  # a requeued task appends instead of truncating
        "--requeue",
        f"--signal=B:USR1@{opts.grace}",  # to the batch shell only: it forwards the signal
        f"--chdir={workdir}",
    ]
    for flag, value in (("partition", opts.partition), ("account", opts.account), ("time", opts.time),
                        ("mem", opts.mem), ("cpus-per-task", opts.cpus_per_task), ("gpus-per-task", opts.gpus_per_task)):
        if value is not None:
            directives.append(f"--{flag}={value}")
    directives += opts.sbatch_options
    run = shlex.join([python, "-m", "batchjob.cli.main", "run", str(job_file), "--output", str(output), "--no-progress"])
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    return f"""#!/bin/bash
# batchjob: {job_file.name} as a Slurm array of {n} shards into {output}
# Written by `batchjob slurm submit`; submit again with `sbatch {slurm_folder(output) / SCRIPT}`,
# or rerun single shards with e.g. `sbatch --array=2 {slurm_folder(output) / SCRIPT}`.
# Array task K runs shard K/{n} into {output}/shard-KKKKK-of-{n:05d}/ and resumes there after a requeue.
{header}

set -u
[ -n "${{SLURM_CPUS_PER_TASK:-}}" ] && export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
task="${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
echo "batchjob: task $task (shard $SLURM_ARRAY_TASK_ID/{n}) start #${{SLURM_RESTART_COUNT:-0}} on $(hostname) at $(date -Is)"

# batchjob runs in the background so that this shell can take Slurm's signals while it waits:
# USR1 (the warning {opts.grace} s before the time limit, or `scancel -b --signal=USR1`) reaches only this
# shell: it is forwarded, batchjob drains, commits, exits {EXIT_RESUMABLE}, and this task requeues itself.
# TERM (scancel, scontrol requeue, preemption, the time limit) reaches batchjob from Slurm as well: this
# shell only waits for it to commit (within Slurm's KillWait); Slurm decides whether the task comes back.
{run} --shard "$SLURM_ARRAY_TASK_ID/{n}" &
pid=$!
warned=0
trap 'warned=1; kill -USR1 $pid 2>/dev/null' USR1
trap '' TERM  # set after batchjob started: batchjob keeps its own TERM handler
# Wait in short sleeps: a signal then interrupts a sleep, never `wait $pid` (bash 5 can lose the exit
# status of a child that ends while a trap interrupts the wait for it).
while kill -0 $pid 2>/dev/null; do sleep 1 & wait $!; done
wait $pid
rc=$?

if [ $rc = {EXIT_RESUMABLE} ] && [ $warned = 1 ]; then
  # Drained and committed after the warning: put this task back in the queue; it resumes where it stopped.
  # (A cluster whose slurm.conf has RequeueExit={EXIT_RESUMABLE} requeues on the exit code alone; that is the
  # fallback below when scontrol is refused.)
  echo "batchjob: task $task stopped resumably at $(date -Is); requeueing"
  scontrol requeue "$task" && exit 0
  echo "batchjob: scontrol requeue $task failed; exiting {EXIT_RESUMABLE} (requeued where RequeueExit={EXIT_RESUMABLE})"
fi
echo "batchjob: task $task exits $rc at $(date -Is)"
exit $rc
"""


def sbatch(script: Path) -> str:
    """Submit `script`; the job id."""
    if shutil.which("sbatch") is None:
        raise SlurmError("sbatch not found: run this on a Slurm login node (or submit the script written above)")
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SlurmError(f"sbatch refused {script}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]  # "<id>[;<cluster>]"


def record_submission(out: Path, job_id: str, opts: SubmitOptions, script: Path) -> None:
    line = json.dumps({"job_id": job_id, "shards": opts.shards, "script": str(script), "submitted": utc_now()})
    with File(disk(), slurm_folder(out) / SUBMISSIONS, append=True) as f:
        f.write(line + "\n")
        f.sync()


def last_submission(out: Path) -> dict | None:
    try:
        lines = (slurm_folder(out) / SUBMISSIONS).read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def task_states(job_id: str) -> dict[int, str] | None:
    """Array task id -> Slurm state (PENDING, RUNNING, REQUEUED, COMPLETED, ...) while Slurm still
    knows the job; {} once it has forgotten it; None where there is no squeue."""
    if shutil.which("squeue") is None:
        return None
    try:
        proc = subprocess.run(["squeue", "--states=all", "-h", "-r", "-j", job_id, "-o", "%K|%T"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states: dict[int, str] = {}
    for line in proc.stdout.splitlines():
        task, _, state = line.strip().partition("|")
        if task.isdigit():
            states[int(task)] = state
    return states


@dataclass(slots=True, frozen=True)
class SubmittedJob:
    """What submitting needs of a job file (the caller loads and validates it: cli/main.py)."""
    job_file: Path
    input: str
    output: str
    drain_timeout: float
    per_lane_inputs: bool


def submit(cfg: SubmittedJob, opts: SubmitOptions, *, dry_run: bool = False) -> tuple[str, str | None, Path, list[str]]:
    """Check the job against its output folder, write the script there and sbatch it.
    Returns (script text, job id or None on a dry run, output folder, warnings)."""
    from batchjob.io.manifest import MANIFEST
    from batchjob.sharding.shards import JobFile

    job_file = cfg.job_file
    if cfg.per_lane_inputs:
        raise ConfigError("lanes with their own inputs cannot be sharded; submit each lane's input as its own job")
    if opts.grace < 1:
        raise ConfigError(f"grace: must be >= 1 second, got {opts.grace}")
    if not Path(cfg.input).exists():
        raise ConfigError(f"input: {cfg.input} not found (relative paths are taken from {Path.cwd()}, where the "
                          "tasks will run too)")
    out = Path(cfg.output).resolve()
    job = JobFile.load(out)
    if job is not None and job.shards != opts.shards:
        raise ConfigError(f"{out} is a job of {job.shards} shards ({out / 'job.json'}); submit with --shards "
                          f"{job.shards} to continue it, or use a new output folder")
    if (out / MANIFEST).exists():
        raise ConfigError(f"{out} holds the results of an unsharded run; use a new output folder for a sharded job")
    previous = last_submission(out)
    if previous and not dry_run:
        active = {k: s for k, s in (task_states(previous["job_id"]) or {}).items()
                  if s in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD")}
        if active:
            raise SlurmError(f"job {previous['job_id']} for {out} still has tasks in the queue "
                             f"({', '.join(f'{k}: {s}' for k, s in sorted(active.items()))}); "
                             f"wait for it or `scancel {previous['job_id']}` first")
    warnings = []
    if cfg.drain_timeout + 10 > opts.grace:
        warnings.append(f"--grace {opts.grace}s leaves less than 10 s after drain_timeout ({cfg.drain_timeout:g}s) "
                        "for the commit: a task may be killed at its time limit before it commits its last rows "
                        "(they are recomputed after the requeue); raise --grace or lower drain_timeout")
    text = render_script(Path(job_file), out, opts)
    script = slurm_folder(out) / SCRIPT
    if dry_run:
        return text, None, out, warnings
    disk().mkdir(slurm_folder(out) / "logs")  # Slurm does not create log folders
    from batchjob.io.manifest import atomic_write

    atomic_write(script, text.encode())
    job_id = sbatch(script)
    record_submission(out, job_id, opts, script)
    return text, job_id, out, warnings
