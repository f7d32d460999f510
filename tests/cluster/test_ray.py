"""`batchjob ray submit` on a real Ray started here (issue 35): a head and a second worker node as local processes
(dashboard off, usage stats off, a small object store); a 4-shard job over both nodes gives the rows and text of a
plain `batchjob run`, each row once, with either runner (actors that keep the model loaded between shards, or a
task per shard) and through Ray Client; a shard whose process is SIGKILLed mid-shard is retried and resumes (exactly
once, the same text), and so is one whose node is lost; a shard that cannot succeed fails after its retries, naming
itself, while the other shards complete; a driver stopped by Ctrl-C drains, and one killed continues on a rerun; a
rerun of a finished job runs nothing; a Ray Dataset through LLMStage answers as `batchjob run`."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.sharding.sharded_output import shard_states
from batchjob.io.manifest import Manifest
from tests.builders import exported as export_rows, rows_a_step

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
ROWS = 24
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    address: str  # the head's GCS address
    client_address: str  # its Ray Client server: ray://
    nodes: list[subprocess.Popen]  # `ray start --block` of the head, then of the second node


# Ray's GCS takes a node for dead after `failure_threshold` missed health checks, one every `period`: 5 x 3 s by
# default. The cluster whose node the test kills checks every second, so the lost shard is retried seconds later.
QUICK_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                       "RAY_health_check_failure_threshold": "3"}


@contextlib.contextmanager
def ray_cluster(env: dict | None = None):
    """A head node and a second node, one CPU each, as local `ray start --block` processes in process groups of their
    own (nothing else on the machine is stopped with them). Their temporary folder is a short one of its own: Ray's
    socket paths below it must fit a Unix socket's 107 characters (under pytest's own folder, with a pytest-xdist
    worker's name in it, they did not, and the second node died at start)."""
    env = {**ENV, **(env or {})}
    temp = Path(tempfile.mkdtemp(prefix="ray-"))
    ray = str(Path(sys.executable).parent / "ray")
    port, client_port = _free_port(), _free_port()  # ephemeral ports: outside Ray's worker ports (10002-19999)
    address = f"127.0.0.1:{port}"
    common = ["--block", "--num-cpus", "1", "--object-store-memory", str(100 << 20), "--disable-usage-stats"]
    nodes = [subprocess.Popen([ray, "start", "--head", "--port", str(port), "--include-dashboard=false",
                               f"--ray-client-server-port={client_port}", f"--temp-dir={temp}", *common], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        _wait_for_port(port, nodes[0])
        nodes.append(subprocess.Popen([ray, "start", "--address", address, *common], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        _wait_for_nodes(address, 2, nodes)
        yield Cluster(address, f"ray://127.0.0.1:{client_port}", nodes)
    finally:
        # SIGTERM: `ray start --block` stops the processes it started, but takes 33 s here with nothing to stop;
        # 2 s later every process of each node still there (its session: raylet, GCS, workers) is killed
        for node in reversed(nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + 2
        for node in reversed(nodes):
            try:
                node.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_node(node)
                node.wait()
        shutil.rmtree(temp, ignore_errors=True)


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL every process of a node's session (Ray's workers each have a process group of their own)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(entry.name)) == node.pid:
                    os.kill(int(entry.name), signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster() as running:
        yield running


def _wait_for_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + GUARD  # a hang guard: on a busy machine Ray starts slower
    while time.monotonic() < deadline:
        assert proc.poll() is None, "ray start --head exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray head did not listen on {port}")


def _wait_for_nodes(address: str, count: int, nodes: list[subprocess.Popen]) -> None:
    probe = f"import ray; ray.init(address={address!r}); print(sum(n['Alive'] for n in ray.nodes()))"
    deadline = time.monotonic() + GUARD  # a hang guard: on a busy machine Ray starts slower
    while time.monotonic() < deadline:
        assert all(node.poll() is None for node in nodes), "a `ray start` exited before its node joined"
        out = subprocess.run([sys.executable, "-c", probe], env=ENV, capture_output=True, text=True, timeout=GUARD)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{count} Ray nodes did not join {address}")

# the uninterrupted runs the Ray jobs are compared with take many rows a step: a row's text does not depend on the
# rows beside it (the engine's batch invariance, tested in tests/engine), and the reference is done in a fraction of
# the time the one-row-a-step shards take (slow on purpose: a stop must find rows left)
REFERENCE_SEQS = 32
GUARD = 1800  # s: a hang guard, never a window the test's outcome depends on; every wait ends on an event


def until(proc: subprocess.Popen, found):
    """Poll `found()` until it gives something true (returned) or the driver ends (None). On a busy machine it only
    waits longer; past the hang guard it fails saying the driver still runs (not that it finished first)."""
    t0 = time.monotonic()
    while proc.poll() is None:
        try:
            hit = found()
        except Exception:  # noqa: BLE001 - a reader may race a commit
            hit = None
        if hit:
            return hit
        assert time.monotonic() - t0 < GUARD, f"the driver still runs after {GUARD} s and the awaited state never came"
        time.sleep(0.01)
    return None


def committing(out: Path, shard: int) -> bool:
    """Shard `shard` has committed rows and has rows left."""
    state = shard_states(out)[1][shard] if (out / "job.json").is_file() else None
    return state is not None and state.done > 0 and not state.complete


def job_file(tmp_path: Path, model: Path, name: str, rows: list[dict], seqs: int = 2, **extra) -> Path:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = [f'model = "{model}"', f'input = "{src}"', f'output = "{tmp_path / name}"', "part_rows = 2",
             "part_seconds = 0.2", 'keep_columns = ["id"]', *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
             "[sampling]", "max_tokens = 12", "ignore_eos = true", "temperature = 0.8", "seed = 5",
             "[engine]", f"max_num_seqs = {seqs}", "kv_cache_gb = 0.02"]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def many_rows_a_step(job: Path) -> None:
    """REFERENCE_SEQS rows a step for the runs that start from now on (a shard reads the job file when it starts)."""
    rows_a_step(job, REFERENCE_SEQS)


def submit(job: Path, address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchjob", "ray", "submit", str(job), "--address", address, *args],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def shard_process(out: Path, shard: int) -> int | None:
    """The pid of the process running shard `shard` (an actor's worker, or a task's `batchjob run` child), as its
    manifest records the run, while it runs."""
    folder = next(out.glob(f"shard-{shard:05d}-of-*"), None)
    try:
        manifest = Manifest.load(folder) if folder is not None else None
    except Exception:  # noqa: BLE001 - a reader may race the first commit
        return None
    run = (manifest.extra.get("run") or {}) if manifest is not None else {}
    return run.get("pid") if run.get("state") == "running" else None


def exported(out: Path, tmp_path: Path) -> list[dict]:
    return export_rows(out, tmp_path / f"{out.name}.parquet", ["row_index", "id", "generated_text", "finish_reason"])


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture()
def rows():
    return [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox " + "jumps " * (i % 5)} for i in range(ROWS)]


@pytest.mark.parametrize("runner, via", [("tasks", "gcs"), ("actors", "ray client")])
def test_four_shards_over_two_nodes_give_the_plain_runs_rows_once(tmp_path, cluster, model, rows, runner, via):
    """Either runner, the driver joining the cluster at its GCS address or through Ray Client (ray://). Actors at the
    GCS address, the default, run in every test below that submits to the module's cluster."""
    plain = job_file(tmp_path, model, "plain", rows)
    assert CliRunner().invoke(main, ["run", str(plain), "--no-progress"]).exit_code == 0
    job = job_file(tmp_path, model, "ray", rows)
    address = cluster.address if via == "gcs" else cluster.client_address
    proc = submit(job, address, "--shards", "4", "--runner", runner)
    out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    assert f"4 shards on Ray ({address}, {runner}, 2 at a time)" in err
    assert f"finished: {ROWS} rows (0 errors) in all; 4 shards" in out
    want = exported(tmp_path / "plain", tmp_path)
    got = exported(tmp_path / "ray", tmp_path)
    assert [r["row_index"] for r in got] == list(range(ROWS)) and got == want
    again = submit(job, address)  # a rerun: the count from OUT/job.json, every shard finished already
    _, err = again.communicate(timeout=GUARD)
    assert again.returncode == 0 and "4 already finished" in err, err


@pytest.mark.parametrize("runner", ["actors", "tasks"])
def test_a_shard_killed_mid_run_is_retried_and_resumes_exactly_once(tmp_path, cluster, model, runner):
    rows = [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox"} for i in range(160)]  # a shard of ~2 s
    plain = job_file(tmp_path, model, "plain", rows, seqs=REFERENCE_SEQS)
    assert CliRunner().invoke(main, ["run", str(plain), "--no-progress"]).exit_code == 0
    job = job_file(tmp_path, model, "ray", rows, seqs=1)
    proc = submit(job, cluster.address, "--shards", "2", "--max-retries", "2", "--runner", runner)
    killed = until(proc, lambda: committing(tmp_path / "ray", 1) and shard_process(tmp_path / "ray", 1))
    if killed:
        os.kill(killed, signal.SIGKILL)
        many_rows_a_step(job)  # the retry: the shard's rows left in a few steps
    out, err = proc.communicate(timeout=GUARD)
    assert killed, "the driver ended before shard 1 committed a row with rows left"
    assert proc.returncode == 0, err
    assert exported(tmp_path / "ray", tmp_path) == exported(tmp_path / "plain", tmp_path)


def test_a_node_lost_mid_shard_its_shard_resumes_on_the_other_node(tmp_path, model):
    """The second node's processes all SIGKILLed while its actor runs a shard: Ray restarts the actor on the head
    once the head's actor has no shard left (it gives its CPU back), and the shard resumes, exactly once."""
    # 640 rows: after the first commit a shard has ~280 rows left, far more than the ~1 s the stop takes to reach it
    # (the driver's and the worker's 0.5 s polls); with 160, an idle machine finished them first (exit 0, not 75)
    rows = [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox"} for i in range(640)]
    plain = job_file(tmp_path, model, "plain", rows, seqs=REFERENCE_SEQS)
    assert CliRunner().invoke(main, ["run", str(plain), "--no-progress"]).exit_code == 0
    job = job_file(tmp_path, model, "ray", rows, seqs=1)
    with ray_cluster(QUICK_HEALTH_CHECKS) as lost:
        proc = submit(job, lost.address, "--shards", "2", "--max-retries", "2")
        def on_second() -> int | None:  # the shard whose process is in the second node's session, mid-shard
            for k in (0, 1):
                pid = shard_process(tmp_path / "ray", k)
                if pid and os.getsid(pid) == lost.nodes[1].pid and committing(tmp_path / "ray", k):
                    return k + 1  # true for shard 0 too
            return None

        second = until(proc, on_second)
        assert second, "no shard ran on the second node before the job ended"
        kill_node(lost.nodes[1])  # its raylet, its workers, everything
        many_rows_a_step(job)  # the lost shard's rerun: after the stop, the rows in a few steps
        out, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, err
    assert exported(tmp_path / "ray", tmp_path) == exported(tmp_path / "plain", tmp_path)


def test_a_shard_that_cannot_succeed_fails_after_its_retries_and_the_others_complete(tmp_path, cluster, model, rows):
    for r in rows[18:]:  # the last shard's rows: too long for the context, each a row error; max_errors 0 fails it
        r["prompt"] = "word " * 400
    job = job_file(tmp_path, model, "ray", rows, max_errors=0, max_model_len=128)
    proc = submit(job, cluster.address, "--shards", "4", "--max-retries", "1")
    _, err = proc.communicate(timeout=GUARD)
    assert proc.returncode == 1, err
    assert "shard 3 failed after its retries" in err and "shard 0 failed" not in err
    _, states = shard_states(tmp_path / "ray")
    assert [s.complete for s in states] == [True, True, True, False]


def test_the_driver_stopped_by_ctrl_c_drains_and_a_killed_driver_continues_on_rerun(tmp_path, cluster, model):
    """One job stopped twice: Ctrl-C, and the running shards drain and commit, exit 75; a rerun continues, and is
    SIGKILLed once it has committed rows of its own; the next rerun finishes. Every row once, the text of a plain run.
    The Ctrl-C is sent once shard 1 has committed rows and has rows left; if the shards still finish everything within
    the second a stop takes to reach them (the driver's and the worker's 0.5 s polls), there was nothing to drain and
    the case runs again with four times the rows. The last rerun takes many rows a step, as a user who resumes with
    another batch size does: the engine's batch is not part of the job, and a row's text does not depend on it."""
    for count in (640, 2560, 10240):
        rows = [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox"} for i in range(count)]
        job = job_file(tmp_path, model, f"stopped-{count}", rows, seqs=1)
        out = tmp_path / f"stopped-{count}"
        proc = submit(job, cluster.address, "--shards", "2")
        assert until(proc, lambda: committing(out, 1)), "the driver ended before shard 1 committed a row"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=GUARD)
        if proc.returncode != 0:
            break  # else: every row was done before the stop reached the shards; nothing to drain
    assert proc.returncode == 75, err
    assert "stopped; rerun" in err
    drained = shard_states(out)[1][1].done
    proc = submit(job, cluster.address)  # continues, and is killed once it has committed rows itself
    killed = until(proc, lambda: committing(out, 1) and shard_states(out)[1][1].done > drained)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=GUARD)
    assert killed, "the rerun ended before shard 1 committed a row of its own"
    many_rows_a_step(job)
    again = submit(job, cluster.address)
    _, err = again.communicate(timeout=GUARD)
    assert again.returncode == 0, err
    plain = job_file(tmp_path, model, f"plain-{count}", rows, seqs=REFERENCE_SEQS)
    assert CliRunner().invoke(main, ["run", str(plain), "--no-progress"]).exit_code == 0
    assert exported(out, tmp_path) == exported(tmp_path / f"plain-{count}", tmp_path)


def test_a_probe_file_is_seen_only_where_it_is(tmp_path):
    from batchjob.ray.worker import sees_file

    (tmp_path / "probe").write_text("token")
    assert sees_file(str(tmp_path / "probe"), "token")
    assert not sees_file(str(tmp_path / "probe"), "other") and not sees_file(str(tmp_path / "none"), "token")


def test_an_object_store_output_is_refused_in_one_line(tmp_path, model, rows):
    job = job_file(tmp_path, model, "x", rows)
    job.write_text(job.read_text().replace(f'output = "{tmp_path / "x"}"', 'output = "s3://bucket/answers"'))
    result = CliRunner().invoke(main, ["ray", "submit", str(job), "--shards", "2"])
    assert result.exit_code == 1
    assert "output s3://bucket/answers: object-store URLs (s3://, gs://, ...) are not supported" in result.output
    assert not (Path.cwd() / "s3:").exists()


def test_without_ray_installed_the_command_says_how_to_get_it(tmp_path, model, rows, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    result = CliRunner().invoke(main, ["ray", "submit", str(job_file(tmp_path, model, "x", rows)), "--shards", "2"])
    assert result.exit_code == 1 and ".venv/bin/pip install -e '.[ray]'" in result.output
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
    shutil.rmtree(tmp_path / "x", ignore_errors=True)


def test_a_ray_dataset_through_the_llm_stage_answers_as_batchjob_run(tmp_path, cluster, model, monkeypatch):
    """200 rows of a ray.data Dataset through map_batches with one LLMStage actor: the same text as `batchjob run`
    on the same rows (greedy). The driver (this process) joins the module's cluster: a Ray of its own would start
    one more GCS, raylet and set of workers for this test alone."""
    import ray

    from batchjob import LLMStage

    rows = [{"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox " + "jumps " * (i % 7)} for i in range(200)]
    plain = job_file(tmp_path, model, "plain", rows, seqs=32)
    plain.write_text(plain.read_text().replace("temperature = 0.8", "temperature = 0.0"))
    assert CliRunner().invoke(main, ["run", str(plain), "--no-progress"]).exit_code == 0
    want = {r["id"]: r["generated_text"] for r in exported(tmp_path / "plain", tmp_path)}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # for this test only: the session's environment stays as it was
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        ds = ray.data.from_items(rows).map_batches(
            LLMStage, fn_constructor_kwargs={"model": str(model), "engine": {"max_num_seqs": 32, "kv_cache_gb": 0.02},
                                             "max_tokens": 12, "ignore_eos": True},
            concurrency=1, batch_size=64, num_cpus=1)
        got = ds.take_all()
    finally:
        ray.shutdown()
    assert sorted(r["id"] for r in got) == sorted(want)
    assert {r["id"]: r["generated_text"] for r in got} == want
    assert all(r["error"] is None and r["completion_tokens"] == 12 for r in got)


def test_a_local_submit_says_our_lines_first_and_writes_where_output_says(tmp_path, model, rows):
    """Ray's own log lines (its token authentication's WARNING and INFO, "Started a local Ray instance") are not
    shown: the first line is ours. --output overrides the job file's folder, for the driver and every shard. Ray's
    token authentication is left as Ray sets it (the token goes to a HOME of the test's own)."""
    job = job_file(tmp_path, model, "in-file", rows[:4])
    env = {k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"}
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")))
    proc = subprocess.run([sys.executable, "-m", "batchjob", "ray", "submit", str(job), "--shards", "2", "--output",
                           str(tmp_path / "flag")], cwd=REPO, env=env, capture_output=True, text=True, timeout=GUARD)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"batchjob: {job} as 2 shards on Ray (local, "), proc.stderr
    assert all(line.startswith("batchjob: ") for line in proc.stderr.splitlines()), proc.stderr
    assert f"-> {tmp_path / 'flag'}" in proc.stdout and not (tmp_path / "in-file").exists()
    assert [r["row_index"] for r in exported(tmp_path / "flag", tmp_path)] == [0, 1, 2, 3]
