"""What `batchjob run` says before torch is imported or a model loads (job/process/preflight.py): a missing input, a rerun
of a finished job; and an empty input, which loads no model. Each fast path is checked by what it imports and
loads, not by the wall clock."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.manifest import Manifest

# `batchjob run ARGS` in a fresh interpreter, then whether torch was imported (cwd: a temporary folder, so the
# checkout's kernels/ folder is not on the path)
PROBE = ("import sys\nfrom batchjob.cli.main import main\nsys.argv = ['batchjob', 'run', *sys.argv[1:]]\ncode = 0\n"
         "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
         "print('torch imported:', 'torch' in sys.modules, 'exit:', code, file=sys.stderr)\n")


def probe(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_a_missing_input_is_said_before_torch_is_imported(tmp_path, tiny_model_dir):
    done = probe(tmp_path, "--model", tiny_model_dir("llama"), "--input", tmp_path / "missing.jsonl", "--output",
                 tmp_path / "out")
    assert f"batchjob: error: input not found: {tmp_path / 'missing.jsonl'} (--input)" in done.stderr
    assert "torch imported: False exit: 1" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
    bad_column = tmp_path / "in.jsonl"
    bad_column.write_text(json.dumps({"text": "hi"}) + "\n")
    done = probe(tmp_path, "--model", tiny_model_dir("llama"), "--input", bad_column, "--output", tmp_path / "out")
    assert "--prompt-column" in done.stderr and "torch imported: False exit: 1" in done.stderr, done.stderr
    bad_column.write_text(json.dumps({"prompt": "hi"}) + "\n")
    done = probe(tmp_path, "--model", tmp_path / "no-model", "--input", bad_column, "--output", tmp_path / "out")
    assert "no such file or folder" in done.stderr and "torch imported: False exit: 1" in done.stderr, done.stderr


def test_a_finished_job_run_again_is_said_before_torch_is_imported(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    args = ["--model", str(model), "--input", str(src), "--output", str(tmp_path / "out"), "--max-tokens", "2",
            "--no-progress"]
    first = CliRunner().invoke(main, ["run", *args])
    assert first.exit_code == 0, first.stderr
    again = probe(tmp_path, *args)
    assert again.stdout.strip() == f"batchjob: already finished: 4 rows (0 errors) in {tmp_path / 'out'}"
    assert "torch imported: False exit: 0" in again.stderr, again.stderr
    # a trial run's rerun with the same --limit is finished too; without it, the rest runs
    limited = probe(tmp_path, *args, "--limit", "2")
    assert "already finished: 4 rows" in limited.stdout and "torch imported: False" in limited.stderr
    # an embed job's rerun too (its pooling, unset, is the model's default in the fingerprint)
    embed = [*args[:4], "--output", str(tmp_path / "embed"), "--task", "embed", "--no-progress"]
    assert CliRunner().invoke(main, ["run", *embed]).exit_code == 0
    embedded = probe(tmp_path, *embed)
    assert "already finished: 4 rows" in embedded.stdout and "torch imported: False exit: 0" in embedded.stderr, embedded.stderr
    # another parameter is another job: the run goes on, and the Job names what differs
    changed = probe(tmp_path, *args[:-2], "3", "--no-progress")
    assert "differs in: params.max_tokens: 2 -> 3" in changed.stderr and "exit: 1" in changed.stderr, changed.stderr


def test_an_empty_input_loads_no_model(tmp_path, tiny_model_dir, monkeypatch):
    import batchjob.job.options.resolved as job_run  # where a job loads its model

    def refuse(*_, **__):
        raise AssertionError("an empty input loaded the model")

    monkeypatch.setattr(job_run, "load_model", refuse)
    src = tmp_path / "in.jsonl"
    src.write_text("\n")
    out = tmp_path / "out"
    args = ["run", "--model", str(tiny_model_dir("llama")), "--input", str(src), "--output", str(out), "--no-progress"]
    for _ in range(2):  # the first run and a rerun
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (result.stderr, result.exception)
        assert result.stdout.strip() == f"batchjob: the input was empty: 0 rows, nothing to do -> {out}"
    manifest = Manifest.load(out)
    assert manifest.total_rows == 0 and manifest.extra["run"]["state"] == "finished"
    assert manifest.fingerprint["model"]["architecture"] and manifest.fingerprint["params"]["dtype"]


def test_an_output_folder_another_run_holds_is_refused_before_torch_is_imported(tmp_path, tiny_model_dir):
    """The lock is asked first: with a model whose weights are damaged (loading it would fail), the line says the
    folder is in use, and neither torch nor the model was touched."""
    import shutil

    from batchjob.io.lock import OutputLock

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: a load would fail
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    args = ["--model", model, "--input", src, "--output", tmp_path / "out"]
    with OutputLock(tmp_path / "out"):
        held = probe(tmp_path, *args)
        restarted = probe(tmp_path, *args, "--restart")
    for done in (held, restarted):
        assert f"batchjob: error: {tmp_path / 'out'} is in use by process {os.getpid()}" in done.stderr, done.stderr
        assert "torch imported: False exit: 1" in done.stderr and "truncated" not in done.stderr, done.stderr
    free = probe(tmp_path, *args)  # the lock given back: the run goes on and meets the damaged weights
    assert "truncated" in free.stderr and "exit: 1" in free.stderr, free.stderr


def test_a_finished_limit_run_is_finished_on_a_rerun_and_a_failed_one_still_quotes_its_error(tmp_path, tiny_model_dir):
    """A JSONL input is counted as it is read, so a --limit 2 run leaves its length unknown: its rerun is recognised
    as finished all the same, before torch is imported, and by the Job too (Ray's shards run it without the
    preflight): nothing runs and no record is added to commits.log; one whose every row failed exits 1 again,
    quoting its error. Without the limit, the rest runs."""
    from batchjob.job.options.config import load_job
    from batchjob.job.error_budget import AllRowsFailed
    from batchjob.job.run import run_job

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt": ""}) + "\n" for _ in range(4)))
    model = tiny_model_dir("llama")
    for name, path, code in (("good", src, 0), ("bad", bad, 1)):
        out = tmp_path / name
        args = ["--model", str(model), "--input", str(path), "--output", str(out), "--max-tokens", "2", "--no-progress",
                "--limit", "2"]
        first = CliRunner().invoke(main, ["run", *args])
        assert first.exit_code == code, first.output
        log = (out / "commits.log").read_bytes()
        again = probe(tmp_path, *args)
        assert f"torch imported: False exit: {code}" in again.stderr, again.stderr
        cfg = load_job(None, {"model": str(model), "input": str(path), "output": str(out), "max_tokens": 2,
                              "progress": False, "limit": 2})
        if code == 0:
            assert again.stdout.strip() == f"batchjob: already finished: 2 rows (0 errors) in {out}"
            assert run_job(cfg).already_finished
        else:
            assert ("already finished, and every row failed (2 of 2; committed in "
                    f"{out}); the first error: row 0: ") in again.stderr, again.stderr
            with pytest.raises(AllRowsFailed, match="already finished, and every row failed .* the first error: row 0"):
                run_job(cfg)
        assert (out / "commits.log").read_bytes() == log  # nothing ran, nothing was recorded
    rest = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "good"),
                                     "--max-tokens", "2", "--no-progress"])
    assert rest.exit_code == 0 and "4 rows (0 errors) in all; this run 2 rows" in rest.stdout, rest.output
