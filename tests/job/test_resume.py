"""Checkpoint-resume of whole jobs: resuming without re-reading, signals, the lock, corruption, changed
jobs and --restart, per-row errors and --max-errors, a full disk."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.job.options.config import load_job
from batchjob.engine.worker.model_runner import ModelRunner, StepTokens
from batchjob.engine.sample.sampler import SampledTokens
from batchjob.io.manifest import Manifest
from batchjob.io.sink import ArrowSink
from batchjob.io.parts import read_results
from batchjob.io.sources import JsonlSource
from batchjob.job.run import run_job
from batchjob.job.report.stats import StatsRecorder

REPO = Path(__file__).resolve().parents[2]
FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress"]  # small KV and swap pools: quick start-up


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def texts(out: Path) -> list[str]:
    table = read_results(out)
    assert table.column("row_index").to_pylist() == list(range(table.num_rows))  # each row exactly once
    return table.column("generated_text").to_pylist()


class SimulatedKill(BaseException):
    """Ends a job where a SIGKILL would: no handler, no commit (BaseException passes `except Exception`)."""


def test_resume_of_100000_committed_rows_reads_none_of_them(tmp_path, model_dir, monkeypatch):
    """100,000 of 100,100 rows committed, then killed: the resume seeks to the first row not committed.

    The committed state comes from the real job loop (reader, tokenizer, scheduler, sink, resume
    positions) with max_tokens 1; only the forward pass is replaced by a fixed token while building it,
    since 100,000 tiny-model forwards take minutes here. The resume runs the real model."""
    total, committed = 100_100, 100_000
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(total):
            f.write(json.dumps({"prompt": f"row {i}"}) + "\n")
    out = tmp_path / "out"
    cfg = dict(model=str(model_dir), input=str(src), output=str(out), max_tokens=1, progress=False, kv_cache_gb=0.05,
               swap_space_gb=0.01, max_num_seqs=1024, max_num_batched_tokens=16384, part_rows=1000, part_seconds=1e9)
    sampled = [0]

    def fixed_token(self, out):
        rows = [i for i, k in enumerate(out.num_sampled) if k]
        sampled[0] += len(rows)
        return StepTokens(len(out), rows, SampledTokens(torch.full((len(rows),), 5)))

    sinks = set()
    write = ArrowSink.write

    def tracked_write(self, row):
        sinks.add(self)
        return write(self, row)

    def kill_after_row_99999(self, *args):
        if sampled[0] >= committed:  # rows finish in input order here: 0..99,999 are committed, later ones buffered
            for sink in sinks:
                sink.sync()  # the kill comes once the writer thread has committed the parts handed to it
            raise SimulatedKill

    t0 = time.perf_counter()
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "run", fixed_token)
        m.setattr(StatsRecorder, "step", kill_after_row_99999)
        m.setattr(ArrowSink, "write", tracked_write)
        with pytest.raises(SimulatedKill):
            run_job(load_job(None, cfg))
    build_s = time.perf_counter() - t0
    manifest = Manifest.load(out)
    assert manifest.done_rows().ranges() == [(0, committed)] and len(manifest.parts) == 100
    assert manifest.extra["resume_position"][0] == committed

    scanned, parsed = [0], []
    lines, parse = JsonlSource._lines, JsonlSource._parse

    def counting_lines(self, f, offset):
        for item in lines(self, f, offset):
            scanned[0] += 1
            yield item

    def counting_parse(self, row_index, *a):
        parsed.append(row_index)
        return parse(self, row_index, *a)

    monkeypatch.setattr(JsonlSource, "_lines", counting_lines)
    monkeypatch.setattr(JsonlSource, "_parse", counting_parse)
    t0 = time.perf_counter()
    summary = run_job(load_job(None, {**cfg, "part_seconds": 30.0}))
    resume_s = time.perf_counter() - t0
    assert summary.rows == total - committed
    assert parsed == list(range(committed, total))  # only the rows not committed were parsed ...
    # ... or even scanned for newlines (opening the input samples its first lines for the column names)
    assert scanned[0] <= JsonlSource.sample_lines + (total - committed)
    manifest = Manifest.load(out)
    assert manifest.done_rows().ranges() == [(0, total)] and manifest.total_rows == total
    print(f"build {build_s:.1f}s, resume {resume_s:.1f}s")


# signals


def test_a_stop_notice_under_a_progress_bar_starts_its_own_line(capfd):
    from batchjob.job.process.signals import StopSignals

    for bar, start in ((True, "\n"), (False, "")):
        stop = StopSignals(30, bar_shown=lambda: bar)
        stop._handle(signal.SIGINT, None)  # what the installed handler gets
        assert stop.received == "SIGINT"
        assert capfd.readouterr().err.startswith(f"{start}batchjob: SIGINT: admitting no new rows")


def start_job(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "batchjob.cli.main", "run", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_parts(out: Path, proc: subprocess.Popen, parts: int = 1, timeout: float = 1800) -> None:
    """Until `parts` parts are committed (the process must still run); `timeout` is a hang guard, not a window."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            manifest = Manifest.load(out)
        except Exception:
            manifest = None
        if manifest is not None and len(manifest.parts) >= parts:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"the job still runs after {timeout} s with fewer than {parts} parts in {out}")


def test_sigterm_drains_commits_exits_75_and_a_rerun_completes(tmp_path, model_dir):
    # enough rows that the signal lands while rows still wait to be admitted, even on a loaded machine
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps"} for i in range(600)])
    out = tmp_path / "out"
    args = ["--model", model_dir, "--input", src, "--output", out, "--max-tokens", 8, "--part-rows", 10,
            "--max-num-seqs", 16, *FAST]
    proc = start_job(*args)
    wait_for_parts(out, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 75, stderr
    assert "SIGTERM" in stderr and "rerun the same command" in stderr
    run = Manifest.load(out).extra["run"]
    assert run["state"] == "stopped" and run["signal"] == "SIGTERM"
    done = Manifest.load(out).done_rows().count()
    assert 0 < done < 600
    assert "stopped" in cli("status", out)
    printed = cli("run", *args)
    assert f"{600 - done:,} rows" in printed
    assert len(texts(out)) == 600


def _signal_at_call(monkeypatch, calls: dict[int, int]) -> None:
    """Send signals to this process from inside the engine: {forward call number: signal}."""
    run = ModelRunner.run
    count = [0]

    def run_and_signal(self, step):
        count[0] += 1
        if count[0] in calls:
            os.kill(os.getpid(), calls[count[0]])
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", run_and_signal)


def test_running_rows_finish_within_the_drain_timeout_and_waiting_ones_are_left(tmp_path, model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} of the batch"} for i in range(60)])
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 8, "--ignore-eos",
            "--max-num-seqs", 4, "--dtype", "float32", *FAST]
    _signal_at_call(monkeypatch, {3: signal.SIGUSR1})
    cli(*args, code=75)
    # 4 rows were running at the signal: they finished; the 8 queued behind them were not started
    assert Manifest.load(out).done_rows().ranges() == [(0, 4)]
    monkeypatch.undo()
    cli(*args)
    ref = tmp_path / "ref"
    cli(*args[:6], ref, *args[7:])
    assert texts(out) == texts(ref)


def test_a_drain_that_times_out_commits_what_finished(tmp_path, model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(20)])
    out = tmp_path / "out"
    _signal_at_call(monkeypatch, {2: signal.SIGTERM})
    cli("run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 30, "--ignore-eos",
        "--drain-timeout", 0, *FAST, code=75)
    assert Manifest.load(out).done_rows().count() == 0  # nothing had finished; the rows run again
    assert Manifest.load(out).extra["run"]["state"] == "stopped"


def test_a_second_sigint_stops_at_once_and_leaves_a_resumable_folder(tmp_path, model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(40)])
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 10, "--ignore-eos",
            "--max-num-seqs", 8, "--part-rows", 2, *FAST]
    _signal_at_call(monkeypatch, {12: signal.SIGINT, 13: signal.SIGINT})
    result = CliRunner().invoke(main, list(map(str, args)))
    assert result.exit_code == 130, result.output
    assert "stopped at once" in result.output
    assert signal.getsignal(signal.SIGINT) is not None  # the job's handler is gone again
    monkeypatch.undo()
    cli(*args)
    assert len(texts(out)) == 40


# one writer


def test_a_second_writer_is_refused_at_once_naming_the_folder_and_the_pid(tmp_path, model_dir):
    from batchjob.io.lock import OutputLock

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "out"
    with OutputLock(out):
        t0 = time.monotonic()
        printed = cli("run", "--model", model_dir, "--input", src, "--output", out, *FAST, code=1)
        assert time.monotonic() - t0 < 10
    assert str(out) in printed and f"process {os.getpid()}" in printed
    cli("run", "--model", model_dir, "--input", src, "--output", out, *FAST)  # free again


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    from batchjob.io.lock import OutputLock, lock_holder

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from batchjob.io.lock import OutputLock; "
                               "lock = OutputLock(sys.argv[1]); print('locked', flush=True); time.sleep(120)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    seen = lock_holder(tmp_path)
    assert seen.held and seen.pid == holder.pid
    holder.kill()
    holder.wait()
    assert not lock_holder(tmp_path).held
    OutputLock(tmp_path, wait_s=0).release()


# crashes and damage


def test_a_crash_between_part_rename_and_its_commit_record_loses_nothing(tmp_path, model_dir, monkeypatch):
    from batchjob.io.commit_log import CommitLog

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(30)])
    args = ["--model", model_dir, "--input", src, "--max-tokens", 6, "--part-rows", 4, "--dtype", "float32", *FAST]
    out = tmp_path / "out"
    append = CommitLog.append
    calls = [0]

    def crash_on_fourth(self, record):
        calls[0] += 1
        if calls[0] == 4:  # (run start, part 0, part 1,) part 2 is renamed into place: no record
            raise SimulatedKill
        append(self, record)

    monkeypatch.setattr(CommitLog, "append", crash_on_fourth)
    with pytest.raises(SimulatedKill):
        CliRunner().invoke(main, ["run", *map(str, args), "--output", str(out)], catch_exceptions=False)
    monkeypatch.undo()
    listed = [p.name for p in Manifest.load(out).parts]
    assert len(listed) == 2 and (out / "part-00002.arrow").exists()  # an orphan
    assert "22 rows" in cli("run", *args, "--output", out)  # the orphan's 4 rows run again
    assert [p.name for p in Manifest.load(out).parts][:2] == listed
    cli("run", *args, "--output", tmp_path / "ref")
    assert texts(out) == texts(tmp_path / "ref")


def test_damaged_parts_and_manifest_are_repaired_without_losing_committed_rows(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(30)])
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 6, "--part-rows", 5,
            "--dtype", "float32", *FAST]
    cli(*args)
    first = texts(out)
    data = bytearray((out / "part-00001.arrow").read_bytes())
    data[len(data) // 2] ^= 0x55  # bit rot: same size
    (out / "part-00001.arrow").write_bytes(bytes(data))
    part3 = (out / "part-00003.arrow").read_bytes()
    (out / "part-00003.arrow").write_bytes(part3[: len(part3) // 2])  # truncated
    manifest = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(manifest[: len(manifest) // 3])  # torn manifest
    printed = cli(*args)
    assert "10 rows" in printed  # the two damaged parts' rows, no more
    assert texts(out) == first
    assert {"part-00001.arrow.corrupt", "part-00003.arrow.corrupt", "manifest.json.corrupt"} <= {p.name for p in out.iterdir()}


# a different job in the same folder


def test_a_changed_input_model_or_parameter_is_refused_until_restart(tmp_path, model_dir, tiny_model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(6)])
    out = tmp_path / "out"
    base = ["run", "--input", src, "--output", out, "--max-tokens", 4, *FAST]
    cli(*base, "--model", model_dir)
    printed = cli(*base, "--model", model_dir, "--temperature", 0.5, code=1)
    assert "params.temperature: 0.0 -> 0.5" in printed and "--restart" in printed
    printed = cli(*base, "--model", tiny_model_dir("qwen2"), code=1)
    assert "model.architecture" in printed and "--restart" in printed
    with open(src, "a") as f:
        f.write(json.dumps({"prompt": "one more"}) + "\n")
    printed = cli(*base, "--model", model_dir, code=1)
    assert "input.files[0]" in printed and "--restart" in printed
    printed = cli(*base, "--model", model_dir, "--temperature", 0.5, "--restart")
    assert "7 rows" in printed
    assert Manifest.load(out).fingerprint["params"]["temperature"] == 0.5
    assert len(texts(out)) == 7
    assert "already finished: 7 rows" in cli(*base, "--model", model_dir, "--temperature", 0.5)  # the new job resumes as usual


# per-row errors


BOOM_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
                 "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_every_bad_row_kind_becomes_an_error_row_and_the_job_goes_on(tmp_path, model_dir):
    rows = [
        {"prompt": "fine"},
        {"prompt": ""},  # empty
        {"prompt": None},  # null
        {"prompt": ["not", "text"]},  # wrong type
        {"prompt": "word " * 3000},  # longer than the context
        "{this is not json",  # unparseable line
        {"messages": [{"role": "user", "content": "boom"}]},  # the chat template raises
        {"messages": "not a list"},  # wrong type in the messages column
        {"messages": [{"role": "user", "content": "hello"}]},
        "[1, 2]",  # JSON, but not an object
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    template = tmp_path / "boom.jinja"
    template.write_text(BOOM_TEMPLATE)
    out = tmp_path / "out"
    printed = cli("run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 3,
                  "--chat-template", template, *FAST)
    assert "10 rows (8 errors)" in printed
    table = read_results(out)
    errors = table.column("error").to_pylist()
    reasons = table.column("finish_reason").to_pylist()
    assert [r == "error" for r in reasons] == [False, True, True, True, True, True, True, True, False, True]
    assert "empty" in errors[1] and "null" in errors[2] and "expected a string" in errors[3]
    assert "context" in errors[4] or "tokens" in errors[4]
    assert "line 6" in errors[5] and "invalid JSON" in errors[5]
    assert "no boom here" in errors[6] and "messages" in errors[7]
    assert "line 10" in errors[9]


def test_max_errors_fails_the_job_with_everything_so_far_committed(tmp_path, model_dir):
    rows = [{"prompt": "" if i % 7 == 3 else f"Row {i}"} for i in range(40)]  # 6 empty prompts
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 3, "--part-rows", 5, *FAST]
    printed = cli(*args, "--max-errors", 3, code=1)
    assert "4 rows failed, more than max_errors allows (3)" in printed
    manifest = Manifest.load(out)
    assert manifest.totals()["errors"] == 4 and manifest.extra["run"]["state"] == "failed"
    assert "failed" in cli("status", out)
    printed = cli(*args, "--max-errors", "2", code=1)  # already over: fails at once, nothing more runs
    assert "4 rows failed" in printed
    cli(*args, "--max-errors", 10)  # a higher limit: it continues
    assert len(texts(out)) == 40


def test_max_errors_as_a_fraction_of_a_known_row_count(tmp_path, model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["" if i % 5 == 0 else f"Row {i}" for i in range(30)]}), tmp_path / "in.parquet")
    args = ["run", "--model", model_dir, "--input", tmp_path / "in.parquet", "--max-tokens", 2, *FAST]
    printed = cli(*args, "--output", tmp_path / "a", "--max-errors", "10%", code=1)  # 6 errors > 3
    assert "0.1 of the rows, 3" in printed
    cli(*args, "--output", tmp_path / "b", "--max-errors", 0.2)  # 6 errors <= 6
    printed = cli(*args, "--output", tmp_path / "c", "--max-errors", 1.5, code=2)  # a bad value: a usage error
    assert "max_errors" in printed and "fraction" in printed


# job-level problems


def test_an_output_folder_that_cannot_be_written_is_a_clear_error(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    (tmp_path / "file").write_text("x")
    printed = cli("run", "--model", model_dir, "--input", src, "--output", tmp_path / "file" / "out", *FAST, code=1)
    assert str(tmp_path / "file") in printed and "Not a directory" in printed
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: nothing to see
            return
        printed = cli("run", "--model", model_dir, "--input", src, "--output", tmp_path / "ro" / "out", *FAST, code=1)
        assert "cannot use output folder" in printed and "Permission denied" in printed
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def _check_resumable(out: Path) -> int:
    """The folder after a failure: a valid manifest, listed parts intact, no temp file left."""
    manifest = Manifest.load(out)
    for part in manifest.parts:
        assert (out / part.name).stat().st_size == part.bytes
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    return manifest.done_rows().count()


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip() or 'not permitted'}); the RLIMIT_FSIZE test covers a full disk")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_stops_the_job_and_leaves_a_resumable_folder(tmp_path, model_dir, small_tmpfs):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} of a long job"} for i in range(200)])
    out = small_tmpfs / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 4, "--part-rows", 5, *FAST]
    printed = cli(*args, code=1)
    assert "No space left on device" in printed and "rerun the same command" in printed
    done = _check_resumable(out)
    assert 0 < done < 200
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    printed = cli(*args)
    assert f"{200 - done} rows" in printed
    assert len(texts(out)) == 200


def test_a_file_size_limit_hit_while_writing_the_commit_log_leaves_a_resumable_folder(tmp_path, model_dir):
    import resource

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(200)])
    out = tmp_path / "out"
    args = ["--model", model_dir, "--input", src, "--output", out, "--max-tokens", 2, "--part-rows", 5, *FAST]

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))  # the commit log outgrows it after ~10 parts

    proc = subprocess.run([sys.executable, "-m", "batchjob.cli.main", "run", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, preexec_fn=limit_file_size)
    assert proc.returncode == 1, proc.stderr
    assert "commits.log" in proc.stderr and "File too large" in proc.stderr
    done = _check_resumable(out)
    assert 0 < done < 200
    cli("run", *args)
    assert len(texts(out)) == 200


def test_a_job_on_an_moe_model_resumes_after_sigkill_with_identical_text(tmp_path, tiny_model_dir):
    moe = tiny_model_dir("qwen2_moe")  # experts, a shared expert, q/k/v biases
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps"} for i in range(300)])
    ref, out = tmp_path / "ref", tmp_path / "out"
    args = ["--model", moe, "--input", src, "--max-tokens", 8, "--part-rows", 10, "--max-num-seqs", 8, *FAST]
    cli("run", *args, "--output", ref)
    proc = start_job(*args, "--output", out)
    wait_for_parts(out, proc, parts=2)
    proc.kill()  # SIGKILL: no handler, no final commit
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 300
    cli("run", *args, "--output", out)
    assert texts(out) == texts(ref)
