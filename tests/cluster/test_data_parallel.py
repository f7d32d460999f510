"""`batchjob run --data-parallel N` (launch/local.py): N rank processes on this node, shards handed out as ranks ask,
one output folder whose rows are the single process's; a rank SIGKILLed mid-job is replaced and its shard redone, a
driver SIGKILLed mid-job takes its ranks with it and the rerun finishes the job; each row once, the same text."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.sharding.sharded_output import has_job_file, shard_states
from batchjob.errors import ConfigError
from batchjob.io.parts import read_results
from batchjob.launch.local import Placement, place, rank_count

HANG_GUARD_S = 600  # a broken run must not hang the suite; never a timing assertion


def test_ranks_get_their_own_cores_inside_one_numa_node():
    two_nodes = [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    cpus = set(range(8))
    assert place(2, "cpu", 0, cpus, two_nodes) == [Placement(0, (0, 1, 2, 3), numa_node=0),
                                                   Placement(1, (4, 5, 6, 7), numa_node=1)]
    assert [p.cpus for p in place(4, "cpu", 0, cpus, two_nodes)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [p.numa_node for p in place(4, "cpu", 0, cpus, two_nodes)] == [0, 0, 1, 1]
    assert len(place("auto", "cpu", 0, cpus, two_nodes)) == 2  # one per NUMA node
    assert [p.cpus for p in place(3, "cpu", 0, cpus, two_nodes)] == [(0, 1, 2), (3, 4, 5), (6, 7)]  # across nodes
    assert place(2, "cpu", 0, {0, 1}, [(0, (0, 1))]) == [Placement(0, (0,)), Placement(1, (1,))]
    gpus = place("auto", "auto", 2, cpus, two_nodes)  # one per GPU, the cores shared out
    assert [(p.gpu, p.cpus) for p in gpus] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert [p.gpu for p in place(2, "cpu", 2, cpus, two_nodes)] == [None, None]  # --device cpu: the cores
    with pytest.raises(ConfigError, match="3 ranks, but 2 GPUs"):
        place(3, "cuda", 2, cpus, two_nodes)
    with pytest.raises(ConfigError, match="3 ranks, but this process may use 2 cores"):
        place(3, "cpu", 0, {0, 1}, [(0, (0, 1))])
    assert rank_count("auto") == "auto" and rank_count("2") == 2 and rank_count(None) is None
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match="data_parallel"):
            rank_count(bad)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Row {i}: count the"}) + "\n" for i in range(n)))
    return path


def common(model_dir, src, max_tokens=8):
    return ["--model", str(model_dir), "--input", str(src), "--max-tokens", str(max_tokens), "--ignore-eos",
            "--temperature", "0.8", "--seed", "3", "--keep-columns", "id", "--kernels", "torch", "--no-progress",
            "--part-rows", "2"]


def merged(out: Path) -> pa.Table:
    job, states = shard_states(out)
    assert all(s.complete for s in states)
    return pa.concat_tables([read_results(s.folder) for s in states])


def single(tmp_path, args) -> list[dict]:
    done = CliRunner().invoke(main, ["run", *args, "--output", str(tmp_path / "single")], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return read_results(tmp_path / "single").to_pylist()


def test_two_ranks_write_the_single_processs_rows(tmp_path, model_dir):
    args = common(model_dir, write_prompts(tmp_path / "in.jsonl", 30))
    out = tmp_path / "dp"
    done = subprocess.run([sys.executable, "-m", "batchjob", "run", *args, "--output", str(out), "--data-parallel",
                           "2"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert "data parallel: 2 ranks" in done.stderr and "8 shards" in done.stderr
    assert "finished: 30 of 30 rows (0 errors); 2 ranks, 8 shards" in done.stdout
    rows = merged(out)
    assert rows.column("row_index").to_pylist() == list(range(30))
    assert rows.to_pylist() == single(tmp_path, args)
    logs = sorted(p.name for p in (out / "data-parallel").iterdir())
    assert logs == ["rank-0.log", "rank-1.log"]
    # a rerun of a finished job does nothing; an unsharded folder is refused
    again = subprocess.run([sys.executable, "-m", "batchjob", "run", *args, "--output", str(out), "--data-parallel",
                            "2"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert again.returncode == 0 and "8 already finished" in again.stderr
    refused = CliRunner().invoke(main, ["run", *args, "--output", str(tmp_path / "single"), "--data-parallel", "2"])
    assert refused.exit_code == 2 and "holds an unsharded run" in refused.output


def _ranks_of(driver: int) -> list[int]:
    """The driver's rank processes (multiprocessing's spawned children; not its resource tracker)."""
    try:
        children = Path(f"/proc/{driver}/task/{driver}/children").read_text().split()
    except OSError:
        return []
    ranks = []
    for pid in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            pass
    return ranks


def _committed_rows(out: Path) -> int:
    if not has_job_file(out):
        return 0
    try:
        _, states = shard_states(out)
    except Exception:  # noqa: BLE001 - a manifest being replaced: look again
        return 0
    return sum(s.done for s in states)


def _start_and_kill(args, out: Path, rows: int, victim) -> tuple[subprocess.Popen, list[int]]:
    """Start a 2-rank run, wait (on events, not time) until a row is committed, then SIGKILL `victim(driver, ranks)`.
    Returns the driver and its ranks when the kill came before the job ended (else no ranks)."""
    driver = subprocess.Popen([sys.executable, "-m", "batchjob", "run", *args, "--output", str(out),
                               "--data-parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while driver.poll() is None and time.monotonic() < deadline:
        ranks = _ranks_of(driver.pid)
        if len(ranks) == 2 and 0 < _committed_rows(out) < rows:  # mid-job
            os.kill(victim(driver.pid, ranks), signal.SIGKILL)
            return driver, ranks
        time.sleep(0.05)
    return driver, []


@pytest.mark.parametrize("victim", ["rank", "driver"])
def test_a_killed_rank_is_replaced_and_a_killed_driver_continues_on_rerun(tmp_path, model_dir, victim):
    for rows in (48, 192, 768):  # more rows when the job ended before the kill reached it (a fast machine)
        args = common(model_dir, write_prompts(tmp_path / f"in-{rows}.jsonl", rows), max_tokens=48)
        out = tmp_path / f"dp-{rows}"
        driver, ranks = _start_and_kill(args, out, rows, (lambda d, r: r[0]) if victim == "rank" else (lambda d, r: d))
        stdout, stderr = driver.communicate(timeout=HANG_GUARD_S)
        if ranks:
            break
    else:
        pytest.fail("every job ended before the kill reached it")
    if victim == "rank":  # the driver replaced the rank and redid its shard from its last commit
        assert driver.returncode == 0, stderr
        assert "on a new rank" in stderr and "died (killed by signal 9)" in stderr
    else:
        assert driver.returncode == -signal.SIGKILL
        deadline = time.monotonic() + HANG_GUARD_S  # its ranks die with it (PR_SET_PDEATHSIG)
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "the ranks outlived their driver"
        rerun = subprocess.run([sys.executable, "-m", "batchjob", "run", *args, "--output", str(out),
                                "--data-parallel", "2"], capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert rerun.returncode == 0, rerun.stderr
    rows_out = merged(out)
    assert rows_out.column("row_index").to_pylist() == list(range(rows))  # every row once, in order
    assert rows_out.to_pylist() == single(tmp_path, args)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_job_key_and_the_python_api(tmp_path, model_dir):
    # `data_parallel` in a job (here a dict, as batchjob.run takes one): the same rows as one process; 1 is one process
    import batchjob

    src = write_prompts(tmp_path / "in.jsonl", 12)
    job = {"model": str(model_dir), "input": str(src), "max_tokens": 5, "ignore_eos": True, "kernels": "torch",
           "progress": False, "temperature": 0.8, "seed": 3}
    summary = batchjob.run({**job, "output": str(tmp_path / "dp"), "data_parallel": 2})
    assert (summary.rows, summary.total_rows, summary.stopped) == (12, 12, None)
    one = batchjob.run({**job, "output": str(tmp_path / "one"), "data_parallel": 1})  # a plain run: no shards
    assert one.rows == 12 and not has_job_file(tmp_path / "one")
    assert merged(tmp_path / "dp").to_pylist() == read_results(tmp_path / "one").to_pylist()


def test_what_cannot_run_data_parallel_is_said_once_before_any_rank_starts(tmp_path, model_dir):
    src = write_prompts(tmp_path / "in.jsonl", 4)
    base = ["run", "--model", str(model_dir), "--data-parallel", "2", "--no-progress"]
    said = CliRunner().invoke(main, [*base, "--input", str(src), "--output", str(tmp_path / "a"), "--limit", "2"])
    assert said.exit_code == 2 and "--limit with --data-parallel" in said.output
    said = CliRunner().invoke(main, [*base, "--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "b")])
    assert said.exit_code == 1 and "input not found" in said.output
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(src.read_bytes()))
    said = CliRunner().invoke(main, [*base, "--input", str(packed), "--output", str(tmp_path / "c")])
    assert said.exit_code == 1 and "cannot be cut into shards" in said.output
    assert not (tmp_path / "c" / "data-parallel").exists()  # no rank started
