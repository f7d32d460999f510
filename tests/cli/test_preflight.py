"""What `batchjob run` says before torch is imported or a model loads (job/preflight.py): a missing input, a rerun
of a finished job; and an empty input, which loads no model. Each fast path is checked by what it imports and
loads, not by the wall clock."""
from __future__ import annotations

import json
import subprocess
import sys

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
    import batchjob.job.resolved as job_run  # where a job loads its model

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
