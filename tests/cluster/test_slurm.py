"""Sharded array jobs on a real single-node Slurm (slurmctld + slurmd + munge from Debian's packages).

The cluster is set up once per session by tests/cluster/setup_slurm.sh and stopped at the end by the
PIDs this session started. These tests skip only where the cluster cannot be installed: not root,
not Debian, apt-get failing.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.parts import read_results
from tests.builders import rows_a_step

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tests" / "cluster" / "setup_slurm.sh"
STATE = Path(os.environ.get("SLURM_CI_DIR", "/tmp/slurm-ci"))
PIDFILES = {"slurmd": STATE / "slurmd.pid", "slurmctld": STATE / "slurmctld.pid",
            "munged": Path("/run/munge/munged.pid")}  # stopped in this order
BATCHJOB = [sys.executable, "-m", "batchjob.cli.main"]  # the venv's python: the batch scripts use it too
SAMPLE = REPO / "jobs" / "data" / "prompts.jsonl"
ROWS = 200
SHARDS = 4

pytestmark = pytest.mark.slurm


# ---- the cluster ----------------------------------------------------------------------------------


def _why_no_cluster() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"Slurm tests need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "Slurm tests install and start slurmctld/slurmd/munged, which needs root"
    if not Path("/etc/debian_version").exists() or shutil.which("apt-get") is None:
        return "Slurm tests install Slurm with apt-get from Debian's packages; this is not Debian"
    return None


def _alive_pids() -> dict[str, int]:
    pids = {}
    for name, pidfile in PIDFILES.items():
        try:
            pid = int(pidfile.read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            continue
        pids[name] = pid
    return pids


def _stop(name: str, pid: int, timeout: float = 15.0) -> None:
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != name:
            return  # gone, and the PID taken by another process since
        os.kill(pid, signal.SIGTERM)
    except (OSError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running single-node cluster for this session. The daemons a test session starts are
    recorded by PID in STARTED and stopped by the last session using the cluster (each holds
    USERS shared); daemons that were running before any test session are left alone."""
    reason = _why_no_cluster()
    if reason:
        pytest.skip(reason)
    STATE.mkdir(parents=True, exist_ok=True)
    users = open(STATE / "pytest-users.lock", "a")
    fcntl.flock(users, fcntl.LOCK_SH)  # before setup: nobody stops the daemons under us from now on
    try:
        before = _alive_pids()
        env = {**os.environ, "SLURM_CI_DIR": str(STATE)}
        t0 = time.monotonic()
        proc = subprocess.run(["bash", str(SETUP)], env=env, capture_output=True, text=True, timeout=900)
        started = {name: pid for name, pid in _alive_pids().items() if before.get(name) != pid}
        _record_started(started)  # saved before anything else can fail
        if proc.returncode != 0:
            if "apt-get" in proc.stderr:
                pytest.skip(f"Slurm could not be installed: {proc.stderr.strip().splitlines()[0]}")
            pytest.fail(f"setup_slurm.sh failed:\n{proc.stdout}\n{proc.stderr}")
        print(f"\nslurm: {proc.stdout.strip()} ({time.monotonic() - t0:.1f}s; started here: {started or 'nothing'})")
        yield STATE
    finally:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last session using the cluster
            alone = True
        except BlockingIOError:
            alone = False
        if alone:
            _stop_started()
        else:
            print("slurm: another test session still uses the cluster; the last one stops it")
        users.close()


STARTED = STATE / "pytest-started.json"  # daemons test sessions started and nobody has stopped yet


def _record_started(started: dict[str, int]) -> None:
    if not started:
        return
    try:
        known = json.loads(STARTED.read_text())
    except (OSError, ValueError):
        known = {}
    STARTED.write_text(json.dumps({**known, **started}))


def _stop_started() -> None:
    try:
        known = json.loads(STARTED.read_text())
    except (OSError, ValueError):
        return
    for name in PIDFILES:  # slurmd, slurmctld, then munged
        if name in known:
            _stop(name, int(known[name]))
    STARTED.unlink(missing_ok=True)


# ---- helpers ---------------------------------------------------------------------------------------


GUARD = 1800  # s: a hang guard; every wait ends on an event (a state, a commit, a log line), never a window


def batchjob(*args, check: bool = True, timeout: float = GUARD) -> subprocess.CompletedProcess:
    proc = subprocess.run([*BATCHJOB, *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"batchjob {' '.join(map(str, args))}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def task_states(job_id: str) -> dict[int, str]:
    proc = subprocess.run(["squeue", "--states=all", "-h", "-r", "-j", job_id, "-o", "%K|%T"],
                          capture_output=True, text=True, timeout=GUARD)
    states = {}
    for line in proc.stdout.splitlines():
        task, _, state = line.partition("|")
        if task.isdigit():
            states[int(task)] = state
    return states


def slurm(*args) -> None:
    """Run a Slurm command. Its exit status is not trusted: while a job changes state Slurm can deliver
    a signal and still answer "Job can not be altered now"; the tests check the effect instead."""
    for _ in range(10):
        proc = subprocess.run(args, capture_output=True, text=True, timeout=GUARD)
        print(f"{' '.join(args)}: exit {proc.returncode} {proc.stderr.strip()}")
        if args[0] != "scontrol" or "can not be altered now" not in proc.stderr:
            return
        time.sleep(0.3)


def logs(out: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted((out / "slurm" / "logs").glob("*.log")))


def wait_until(predicate, what: str, out: Path, poll: float = 0.2, timeout: float = GUARD):
    """Until `predicate()` gives something true (returned); `timeout` is a hang guard, not a window: a busy machine
    only makes the wait longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"still waiting after {timeout:.0f} s (the hang guard) for {what}\n{logs(out)}")


def wait_for_job(job_id: str, out: Path) -> dict[int, str]:
    failed = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

    def finished():
        states = task_states(job_id)
        if any(s in failed for s in states.values()):
            pytest.fail(f"Slurm job {job_id}: {states}\n{logs(out)}")
        return states if len(states) == SHARDS and set(states.values()) == {"COMPLETED"} else None

    return wait_until(finished, f"Slurm job {job_id} to complete", out, poll=0.5)


def committed(folder: Path) -> int:
    try:
        manifest = Manifest.load(folder)
    except (ManifestError, OSError):
        return 0  # being replaced right now
    return manifest.num_rows() if manifest else 0


def write_job(path: Path, data: Path, out: Path, seqs: int = 1) -> Path:
    """A job whose rows take a while: sampled, a fixed length, small parts committed often. With one row per engine
    step (`seqs`, the default) a shard of 50 rows runs for ~20 s: far longer than a signal takes to reach it, even
    on a busy machine (with 96 tokens a row, a task on a machine 90% busy did 30 rows before the other task, started
    beside it, had committed one). A row's text does not depend on the rows beside it (the engine's batch
    invariance, tested in tests/engine), so the reference and the array job that nothing interrupts run many rows a
    step: same rows, same text, a few seconds."""
    path.write_text(f'''model = "{data.parent / 'model'}"
input = "{data}"
output = "{out}"
keep_columns = ["id"]
max_tokens = 192
ignore_eos = true
temperature = 0.8
seed = 11
part_rows = 2
part_seconds = 0.5
drain_timeout = 5
progress = false

[engine]
threads = 1
kv_cache_gb = 0.02
preemption = "recompute"
max_num_seqs = {seqs}
''')
    return path


@pytest.fixture(scope="module")
def sample(tmp_path_factory, tiny_model_dir) -> Path:
    """The first 200 sample prompts and the tiny model beside them (the tasks read both)."""
    folder = tmp_path_factory.mktemp("slurm_sample")
    shutil.copytree(tiny_model_dir("llama", max_positions=1024), folder / "model")
    lines = SAMPLE.read_text().splitlines()[:ROWS]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "prompts.jsonl"


@pytest.fixture(scope="module")
def reference(sample, tmp_path_factory) -> pa.Table:
    """The same job run as one unsharded process."""
    folder = tmp_path_factory.mktemp("slurm_reference")
    job = write_job(folder / "job.toml", sample, folder / "out", seqs=64)
    batchjob("run", job, "--shard", "none")
    table = read_results(folder / "out")
    assert table.column("row_index").to_pylist() == list(range(ROWS))
    return table


def exported(out: Path, to: Path) -> pa.Table:
    batchjob("export", out, "--to", to)
    return pq.read_table(to)


def same_rows(got: pa.Table, want: pa.Table) -> None:
    assert got.column("row_index").to_pylist() == list(range(ROWS))  # every row exactly once, in input order
    for name in want.schema.names:
        assert got.column(name).to_pylist() == want.column(name).to_pylist(), name


def submit(job: Path, *extra) -> str:
    proc = batchjob("slurm", "submit", job, "--shards", SHARDS, "--grace", 60, *extra)
    job_id = proc.stdout.strip()
    assert re.fullmatch(r"\d+", job_id), proc.stdout + proc.stderr
    return job_id


# ---- the tests ----------------------------------------------------------------------------------------


def test_dry_run_prints_an_array_script_that_requeues_itself(tmp_path, sample):
    job = write_job(tmp_path / "job.toml", sample, tmp_path / "out")
    proc = batchjob("slurm", "submit", job, "--shards", 8, "--partition", "gpu", "--gpus-per-task", 1,
                    "--time", "2:00:00", "--mem", "16G", "--account", "proj", "--grace", 300, "--dry-run")
    script = proc.stdout
    out = tmp_path / "out"
    for line in ("#SBATCH --array=0-7", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --signal=B:USR1@300", f"#SBATCH --output={out}/slurm/logs/%A_%a.log",
                 "#SBATCH --partition=gpu", "#SBATCH --gpus-per-task=1", "#SBATCH --time=2:00:00",
                 "#SBATCH --mem=16G", "#SBATCH --account=proj"):
        assert line in script.splitlines(), line
    assert f"{sys.executable} -m batchjob.cli.main run {job}" in script  # this venv's batchjob
    assert '--shard "$SLURM_ARRAY_TASK_ID/8" &' in script and "wait $pid" in script
    assert "trap 'warned=1; kill -USR1 $pid 2>/dev/null' USR1" in script
    assert 'if [ $rc = 75 ] && [ $warned = 1 ]' in script
    assert 'scontrol requeue "$task"' in script and 'task="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in script
    assert not out.exists()  # a dry run writes nothing
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_output_flag_overrides_the_job_files_output_as_for_run(tmp_path, sample):
    job = write_job(tmp_path / "job.toml", sample, tmp_path / "out")
    script = batchjob("slurm", "submit", job, "--shards", 2, "--output", tmp_path / "elsewhere", "--dry-run").stdout
    assert f"#SBATCH --output={tmp_path / 'elsewhere'}/slurm/logs/%A_%a.log" in script.splitlines()
    assert f"run {job} --output {tmp_path / 'elsewhere'} --no-progress" in script and f"{tmp_path / 'out'}" not in script


def _traps_set(pid: int) -> bool:
    """The batch shell catches USR1 and ignores TERM (/proc/PID/status: its caught and ignored signal masks)."""
    masks = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return bool(int(masks["SigCgt"], 16) >> (signal.SIGUSR1 - 1) & 1) and bool(int(masks["SigIgn"], 16) >> (signal.SIGTERM - 1) & 1)


FAKE_BATCHJOB = """#!/bin/bash
# stands in for `python -m batchjob.cli.main run ...`: drains on USR1/TERM like batchjob (exit 75)
trap 'echo "batchjob got USR1" >> "$LOG"; exit 75' USR1
trap 'echo "batchjob got TERM" >> "$LOG"; exit 75' TERM
echo "batchjob started: $*" >> "$LOG"
for _ in $(seq $STEPS); do sleep 0.1; done
exit 0
"""


@pytest.mark.parametrize("signal_name,requeued,exit_code", [("USR1", True, 0), ("TERM", False, 75), (None, False, 0)])
def test_batch_script_forwards_signals_and_requeues_only_after_the_warning(tmp_path, signal_name, requeued, exit_code):
    from batchjob.sharding.slurm import SubmitOptions, render_script

    fake = tmp_path / "python"
    fake.write_text(FAKE_BATCHJOB)
    (tmp_path / "scontrol").write_text('#!/bin/bash\necho "scontrol $*" >> "$LOG"\n')
    for f in (fake, tmp_path / "scontrol"):
        f.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_script(tmp_path / "job.toml", tmp_path / "out", SubmitOptions(shards=4), python=str(fake)))
    log = tmp_path / "calls.log"
    log.touch()
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "LOG": str(log),
           "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "9", "STEPS": "6000" if signal_name else "5"}  # 10 min: ended by the signal
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    while not ("started" in log.read_text() and _traps_set(proc.pid)) and proc.poll() is None:
        time.sleep(0.05)  # the fake writes "started" once its traps are set; the batch shell sets its own after it
    assert '--shard 2/4' in log.read_text()
    if signal_name == "USR1":  # --signal=B:USR1: the batch shell only
        proc.send_signal(signal.SIGUSR1)
    elif signal_name == "TERM":  # scancel / scontrol requeue: every process of the job
        os.killpg(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=600)[0]
    calls = log.read_text()
    assert proc.returncode == exit_code, output + calls
    if signal_name:
        assert f"batchjob got {signal_name}" in calls, calls
    assert ("scontrol requeue 7_2" in calls) == requeued, calls


def test_array_job_gives_every_row_once_like_a_single_run(slurm_cluster, sample, reference, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.toml", sample, out, seqs=16)
    t0 = time.monotonic()
    job_id = submit(job)
    assert (out / "slurm" / "batchjob.sbatch").is_file()
    wait_for_job(job_id, out)
    print(f"4-shard array job: {time.monotonic() - t0:.1f}s")
    job_json = json.loads((out / "job.json").read_text())
    assert job_json["shards"] == SHARDS and job_json["total_rows"] == ROWS
    assert [r["start"] for r in job_json["ranges"]] == [0, 50, 100, 150]
    status = batchjob("status", out).stdout
    assert "200/200" in status, status
    same_rows(exported(out, tmp_path / "merged.parquet"), reference)
    # submitting the same folder with another shard count is refused before anything reaches Slurm
    proc = batchjob("slurm", "submit", job, "--shards", 3, check=False)
    assert proc.returncode == 1 and "job of 4 shards" in proc.stderr


def test_preempted_and_requeued_tasks_resume_and_the_result_is_unchanged(slurm_cluster, sample, reference, tmp_path):
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.toml", sample, out)
    t0 = time.monotonic()
    job_id = submit(job)
    folders = [out / f"shard-{k:05d}-of-{SHARDS:05d}" for k in range(SHARDS)]

    def both_running_midway():  # the manifests first (cheap: polled often), then Slurm's view
        done = [committed(f) for f in folders[:2]]
        late = [k for k in (0, 1) if done[k] >= 30]
        assert not late, f"task {late[0]} ran past 30 of its 50 rows before both had committed rows\n{logs(out)}"
        if not all(done):
            return None
        states = task_states(job_id)
        return done if all(states.get(k) == "RUNNING" for k in (0, 1)) else None

    at_signal = wait_until(both_running_midway, "tasks 0 and 1 running with rows committed and rows left", out, poll=0.02)
    status = batchjob("status", out).stdout  # per-shard progress while the job runs
    for k in range(SHARDS):
        assert re.search(rf"^\s*{k}\b.*\b\d+/50\b", status, re.M), status
    assert "RUNNING" in status, status

    def task_log(k: int) -> str:
        return (out / "slurm" / "logs" / f"{job_id}_{k}.log").read_text()

    # The runs after the stop take many rows a step, as a user who resumes with another batch size does: the
    # engine's batch is not part of the job (a row's text does not depend on it). Tasks 0 and 1 read the job file
    # when they started; the runs that read this one (tasks 2 and 3, waiting for a CPU, and the requeued runs) are
    # the test's after part: a few seconds each instead of ~20.
    rows_a_step(job, 16)
    # what Slurm sends `grace` seconds before the time limit, to the batch shell only
    scancel = subprocess.Popen(["scancel", "-b", "--signal=USR1", f"{job_id}_0"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    slurm("scontrol", "requeue", f"{job_id}_1")  # requeued from outside (an admin, a preempting job)
    print(f"signalled at {time.monotonic() - t0:.1f}s with {at_signal} rows committed")
    wait_until(lambda: "requeueing" in task_log(0), "task 0 to requeue itself", out)
    if scancel.poll() is None:
        # Slurm 22.05 answers "Job can not be altered now" to a batch signal for an array task even
        # when the signal got through, and scancel retries every 5 s: it would signal the next run too
        scancel.terminate()
    print(f"scancel: {scancel.communicate()[0].strip() or 'ok'}")
    wait_for_job(job_id, out)
    print(f"preempted + requeued array job: {time.monotonic() - t0:.1f}s")

    for k, sig in ((0, "SIGUSR1"), (1, "SIGTERM")):
        log = task_log(k)
        runs = re.split(r"start #\d+", log)[1:]
        rows = [int(n) for n in re.findall(r"in all; (?:this run )?(\d+) rows", log)]  # each run's own rows
        assert len(runs) >= 2 and f"stopped by {sig}" in runs[0], log  # drained and came back
        assert len(rows) == len(runs) and rows[0] < 50, log
        assert sum(rows) == 50, log  # no row done twice: each run did only what was not committed
    assert "stopped resumably" in task_log(0) and "scontrol requeue" not in task_log(1)
    same_rows(exported(out, tmp_path / "merged.parquet"), reference)
