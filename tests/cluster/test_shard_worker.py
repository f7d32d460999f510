"""The Ray actor's shard runs, in this process (no Ray needed): a ShardWorker runs a job's shards one after another
through the same Job as `batchjob run --shard K/N`, loading the model once for all of them, with the rows and text
of plain shard runs; a model kept for one job is not used for another; the driver's stop file drains a shard
(EXIT_RESUMABLE) and a rerun continues; a shard that fails raises an error naming it."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.errors import EXIT_RESUMABLE
from batchjob.job.options.config import load_job
from batchjob.job.process.kept_models import ModelKeeper
from batchjob.job.run import Job
from batchjob.launch.shard_worker import ShardCall, ShardFailed, ShardWorker
from tests.builders import exported

ROWS = 12


def job_file(tmp_path: Path, model: Path, name: str, rows: int = ROWS, **extra) -> Path:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Row {i}: the quick brown fox"}) + "\n"
                           for i in range(rows)))
    lines = [f'model = "{model}"', f'input = "{src}"', f'output = "{tmp_path / name}"', "part_rows = 2",
             'keep_columns = ["id"]', *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
             "[sampling]", "max_tokens = 8", "ignore_eos = true", "temperature = 0.8", "seed = 3",
             "[engine]", "max_num_seqs = 4", "kv_cache_gb = 0.02"]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def texts(out: Path, tmp_path: Path) -> list[tuple]:
    rows = exported(out, tmp_path / f"{out.name}.parquet", ["id", "generated_text"])
    return [(r["id"], r["generated_text"]) for r in rows]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def call_for(job: Path, count: int) -> ShardCall:
    return ShardCall(str(job.resolve()), count, 1, os.getcwd(), str(job.parent / job.stem / ".driver-stop"))


def test_a_worker_runs_shards_with_one_model_load_and_the_text_of_plain_shards(tmp_path, model):
    plain = job_file(tmp_path, model, "plain")
    for k in range(3):
        result = CliRunner().invoke(main, ["run", str(plain), "--shard", f"{k}/3", "--no-progress"])
        assert result.exit_code == 0, result.output
    job = job_file(tmp_path, model, "actor")
    worker = ShardWorker(call_for(job, 3))
    assert [worker.run(k).exit_code for k in (2, 0, 1)] == [0, 0, 0]
    assert worker.keeper.loads == 1
    got = texts(tmp_path / "actor", tmp_path)
    assert got == texts(tmp_path / "plain", tmp_path) and [i for i, _ in got] == [f"r{i}" for i in range(ROWS)]
    assert worker.run(0).exit_code == 0 and worker.keeper.loads == 1  # a finished shard: nothing to do


def test_a_kept_model_serves_only_the_job_it_was_built_for(tmp_path, model):
    keeper = ModelKeeper()
    one, other = job_file(tmp_path, model, "one", rows=4), job_file(tmp_path, model, "other", rows=4, dtype="bfloat16")
    loads = []
    for job, shard in ((one, "0/2"), (one, "1/2"), (other, "0/1"), (one, "0/2")):
        cfg = load_job(job, {"shard": shard, "progress": False})
        with contextlib.ExitStack() as held:
            Job(cfg, resources=held, keeper=keeper).run()
        loads.append(keeper.loads)
    # one job's shards share a load; another job (here another dtype) loads its own, and the keeper holds only the last
    assert loads == [1, 1, 2, 3]


def test_the_drivers_stop_file_drains_a_shard_and_a_rerun_continues(tmp_path, model):
    plain = job_file(tmp_path, model, "plain")
    assert CliRunner().invoke(main, ["run", str(plain), "--shard", "0/1", "--no-progress"]).exit_code == 0
    job = job_file(tmp_path, model, "actor")
    call = call_for(job, 1)
    worker = ShardWorker(call)
    Path(call.stop_file).parent.mkdir(parents=True, exist_ok=True)
    Path(call.stop_file).write_text("stop")
    assert worker.run(0).exit_code == EXIT_RESUMABLE  # stopped before it began: nothing ran
    os.unlink(call.stop_file)
    assert worker.run(0).exit_code == 0
    assert texts(tmp_path / "actor", tmp_path) == texts(tmp_path / "plain", tmp_path)


def test_a_failed_shard_raises_naming_itself(tmp_path, model):
    job = job_file(tmp_path, model, "bad", max_errors=0, max_model_len=8)  # every prompt too long: row errors
    with pytest.raises(ShardFailed, match=r"^shard 1: ") as failed:
        ShardWorker(call_for(job, 2)).run(1)
    assert "max_errors" in str(failed.value) or "max-errors" in str(failed.value), failed.value
