"""What an operator sees and what a scheduler acts on: exit codes and outcomes (empty input, a finished
job run again, --limit), the start line, plain progress lines when stderr is not a terminal, the final
line over the whole job, Ctrl-C messages, and the hint that an instruct model wants --chat."""
from __future__ import annotations

import json
import os
import re
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.engine.worker.model_runner import ModelRunner
from batchjob.io.manifest import Manifest
from batchjob.job.report.progress import Progress, Snapshot


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama", max_positions=1024))


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(*args, code=0):
    result = CliRunner().invoke(main, ["run", *map(str, args)])
    assert result.exit_code == code, (result.exit_code, result.stderr)
    assert "Traceback" not in result.stderr
    return result


def start_line(stderr: str) -> str:
    """The job's start line: the first line of stderr but for the one that a first compile of the native kernels
    on this machine writes before it (kernels are chosen, and built if need be, before the job starts)."""
    return next(ln for ln in stderr.splitlines() if not re.match(r"batchjob: compiled .*kernels for this CPU", ln))


def signal_at_step(monkeypatch, calls: dict[int, int]) -> None:
    """Signals to this process from inside the engine: {forward call number: signal}."""
    real = ModelRunner.run
    count = [0]

    def run_and_signal(self, step):
        count[0] += 1
        if count[0] in calls:
            os.kill(os.getpid(), calls[count[0]])
        return real(self, step)

    monkeypatch.setattr(ModelRunner, "run", run_and_signal)


def test_the_start_line_counts_one_thread_as_one_thread(monkeypatch):
    from types import SimpleNamespace

    import torch

    from batchjob.job.options.config import JobConfig
    from batchjob.job.report.summary import start_line

    model = SimpleNamespace(dtype=torch.float32, kv_cache_dtype="auto", quantization="none",
                            kernels=SimpleNamespace(label="torch"), device=torch.device("cpu"),
                            weight_memory=lambda: {"float32": 1 << 20}, parallel=None)
    cfg = JobConfig(model="m", input="in.jsonl", output="out")
    for threads, said in ((1, "cpu, 1 thread)"), (2, "cpu, 2 threads)")):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        assert said in start_line(cfg, SimpleNamespace(name="m"), model, ["in.jsonl"], 3, 0, "out")


def test_the_start_line_says_what_runs_and_a_resume_says_how_far_it_is(tmp_path, model):
    src = pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(10)]}), tmp_path / "in.parquet") or tmp_path / "in.parquet"
    out = tmp_path / "out"
    first = run("--model", model, "--input", src, "--output", out, "--max-tokens", 2, "--limit", 4)
    line = start_line(first.stderr)
    assert re.fullmatch(rf"batchjob: {os.path.basename(model)} \((bfloat16|float32), kv cache \1, (native (AVX-512|AVX2|generic C\+\+)|torch) kernels, cpu, "
                        rf"(1 thread|\d+ threads)\) <- {src}, 4 rows \(--limit 4\) -> {out}; weights [\d.]+ [KM]iB \([^)]+\); KV cache "
                        rf"[\d.]+ MiB \(128 rows x "
                        r"1,024 tokens: --max-num-seqs x the model's context; --kv-cache-gb to set\)", line), line
    assert "finished: 4 rows (0 errors) in all" in first.stdout
    again = run("--model", model, "--input", src, "--output", out, "--max-tokens", 2)
    resumed = start_line(again.stderr)
    assert f"10 rows -> {out}; weights " in resumed and "; KV cache " in resumed and resumed.endswith("; resuming: 4 of 10 rows committed")
    assert "finished: 10 rows (0 errors) in all; this run 6 rows (0 errors)" in again.stdout  # the whole job, then this run
    quantized = run("--model", model, "--input", src, "--output", tmp_path / "int8", "--max-tokens", 2, "--limit", 1,
                    "--kv-cache-dtype", "int8")
    assert ", kv cache int8, " in start_line(quantized.stderr)  # a quantized KV cache says so
    int8 = run("--model", model, "--input", src, "--output", tmp_path / "w8a8", "--max-tokens", 2, "--limit", 1,
               "--quantization", "int8")
    assert re.search(r"\((bfloat16|float32), int8 matmuls, kv cache ", start_line(int8.stderr))  # so do int8 matmuls


def test_a_finished_job_run_again_says_so_and_does_nothing(tmp_path, model):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(5)])
    out = tmp_path / "out"
    args = ["--model", model, "--input", src, "--output", out, "--max-tokens", 2, "--no-progress"]
    run(*args)
    parts = sorted(p.name for p in out.glob("part-*"))
    again = run(*args)
    assert again.stdout.strip() == f"batchjob: already finished: 5 rows (0 errors) in {out}"
    assert sorted(p.name for p in out.glob("part-*")) == parts


@pytest.mark.parametrize("kind", ["blank lines", "empty file", "empty parquet"])
def test_an_empty_input_is_a_finished_job_of_zero_rows(tmp_path, model, kind):
    if kind == "empty parquet":
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), src)
    else:
        src = tmp_path / "in.jsonl"
        src.write_text("\n  \n\n" if kind == "blank lines" else "")
    out = tmp_path / "out"
    result = run("--model", model, "--input", src, "--output", out, "--no-progress")
    assert "the input was empty: 0 rows" in result.stdout
    assert Manifest.load(out).done_rows().count() == 0 and Manifest.load(out).extra["run"]["state"] == "finished"


def test_limit_runs_the_first_rows_and_a_rerun_without_it_does_the_rest(tmp_path, model):
    rows = [{"prompt": f"row {i}"} for i in range(9)]
    src = jsonl(tmp_path / "in.jsonl", rows)
    out, ref = tmp_path / "out", tmp_path / "ref"
    common = ["--model", model, "--input", src, "--max-tokens", 3, "--temperature", 0.9, "--seed", 3, "--no-progress"]
    run(*common, "--output", out, "--limit", 4)
    assert Manifest.load(out).done_rows().ranges() == [(0, 4)]
    run(*common, "--output", out)
    run(*common, "--output", ref)
    texts = lambda o: sorted((r["row_index"], r["generated_text"]) for p in o.glob("part-*.arrow")  # noqa: E731
                             for r in pa.ipc.open_file(p).read_all().to_pylist())
    assert texts(out) == texts(ref) and len(texts(out)) == 9


def test_not_a_terminal_gets_a_plain_progress_line_every_log_every_seconds(tmp_path, model):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(24)])
    result = run("--model", model, "--input", src, "--output", tmp_path / "out", "--max-tokens", 40, "--ignore-eos",
                 "--max-num-seqs", 2, "--log-every", 0.01)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("batchjob: progress: ")]
    assert len(lines) >= 3, result.stderr
    # rows done (no total yet: a JSONL read for the first time shows how much of the file is read), rates, ETA
    assert re.search(r"\d+/~?[\d,]+ rows \(\d+\.\d%\), [\d.,]+ rows/s, [\d,]+ tok/s, \d+ committed, \d+ running, \d+ read ahead, ETA", lines[-1])


def test_progress_line_with_a_known_total_counts_the_whole_job():
    clock = iter([0.0, 10.0, 10.0]).__next__
    p = Progress(total_rows=1000, rows_before=400, log_every=30, enabled=False, clock=clock)
    line = p.line(Snapshot(rows_done=500, rows_committed=480, rows_in_flight=16, tokens=12_000), now=10.0)
    assert line == "500/1,000 rows (50.0%), 10.0 rows/s, 1,200 tok/s, 480 committed, 16 running, 0 read ahead, ETA 50s"
    # the rows read ahead (2 x max_num_seqs by default) wait in the engine: they are not said to be computing
    ahead = p.line(Snapshot(rows_done=500, rows_committed=480, rows_in_flight=192, tokens=12_000, rows_read_ahead=128), now=10.0)
    assert ahead.endswith("480 committed, 64 running, 128 read ahead, ETA 50s")


def test_ctrl_c_when_every_row_is_admitted_finishes_them_instead_of_promising_75(tmp_path, model, monkeypatch, capfd):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(6)])
    out = tmp_path / "out"
    signal_at_step(monkeypatch, {5: signal.SIGINT})
    run("--model", model, "--input", src, "--output", out, "--max-tokens", 12, "--ignore-eos", "--no-progress")
    said = capfd.readouterr().err  # the signal handler writes to fd 2 itself
    assert "SIGINT: every row is admitted: finishing the 6 rows in flight" in said
    assert "exiting with 75" not in said
    assert Manifest.load(out).done_rows().count() == 6


def test_status_after_a_double_ctrl_c_says_stopped(tmp_path, model, monkeypatch):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(40)])
    out = tmp_path / "out"
    signal_at_step(monkeypatch, {6: signal.SIGINT, 7: signal.SIGINT})
    run("--model", model, "--input", src, "--output", out, "--max-tokens", 10, "--ignore-eos", "--max-num-seqs", 4,
        "--part-rows", 2, "--no-progress", code=130)
    assert Manifest.load(out).extra["run"]["state"] == "stopped"
    status = CliRunner().invoke(main, ["status", str(out)])
    assert status.output.startswith(f"{out}: stopped") and "killed" not in status.output


def test_plain_prompts_that_stop_at_their_first_token_suggest_chat_once_while_the_job_runs(tmp_path, model):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(40)])
    every_token = ",".join(str(i) for i in range(400))  # whatever comes first ends the row: an instruct model's EOS
    common = ["--model", model, "--input", src, "--max-tokens", 5, "--stop-token-ids", every_token,
              "--max-num-seqs", 4, "--log-every", 1e-6]  # 4 rows a step, a plain progress line after each
    lines = run(*common, "--output", tmp_path / "plain").stderr.splitlines()
    hints = [i for i, line in enumerate(lines) if "ended at their first token" in line]
    assert len(hints) == 1, lines  # once, not again at the end
    hint = lines[hints[0]]
    assert hint.startswith("batchjob: warning: 8 of the first 8 rows ended at their first token") and "--chat" in hint
    later = [int(m[1]) for line in lines[hints[0]:] if (m := re.match(r"batchjob: progress: (\d+)/", line))]
    assert later and min(later) < 40  # said while most rows were still to run
    short = jsonl(tmp_path / "short.jsonl", [{"prompt": f"row {i}"} for i in range(5)])
    ended = run(*common, "--input", short, "--output", tmp_path / "short", "--no-progress")
    assert "5 of 5 rows ended at their first token" in ended.stderr  # too few rows to say it early: at the end
    chat = run(*common, "--output", tmp_path / "chat", "--chat")
    assert "first token" not in chat.stderr


def test_a_folder_fingerprinted_before_content_hashes_resumes_and_is_upgraded(tmp_path, model):
    """Outputs written by an earlier batchjob know their input by path and mtime: same names, sizes and
    columns still resume (no --restart), and the next commit stores the content fingerprint."""
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(6)])
    out = tmp_path / "out"
    args = ["--model", model, "--input", src, "--output", out, "--max-tokens", 2, "--no-progress"]
    run(*args, "--limit", 3)
    manifest = Manifest.load(out)
    new_identity = manifest.fingerprint["input"]
    manifest.fingerprint["input"] = {"path": str(src), "files": [[f[0], f[1], 1_700_000_000] for f in new_identity["files"]],
                                     "columns": new_identity["columns"]}
    manifest.commit(out)
    (out / "manifest.json.prev").unlink(missing_ok=True)
    run(*args)
    assert Manifest.load(out).done_rows().count() == 6 and Manifest.load(out).fingerprint["input"] == new_identity
    (tmp_path / "in.jsonl").write_text(src.read_text().replace("row 5", "row 9"))  # one changed byte: refused
    refused = run(*args, code=1)
    assert "input.files[0]" in refused.stderr and "--restart" in refused.stderr


def test_a_template_error_on_a_row_says_so_once(tmp_path, model):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}"
                        "{% endif %}{{ m['content'] }}{% endfor %}")
    src = jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                        {"messages": [{"role": "tool", "content": "x"}]}])
    out = tmp_path / "out"
    run("--model", model, "--input", src, "--output", out, "--chat-template", template, "--max-tokens", 2, "--no-progress")
    errors = [r["error"] for p in out.glob("part-*.arrow") for r in pa.ipc.open_file(p).read_all().to_pylist() if r["error"]]
    assert errors == ["chat template failed: no tools here"]


def test_the_terminal_bar_moves_before_any_row_has_finished():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream, t = Tty(), [0.0]
    p = Progress(total_rows=100, rows_before=0, log_every=30, stream=stream, clock=lambda: t[0])
    for step in range(1, 5):  # four steps, tokens generated, no row finished yet
        t[0] = step * 0.6
        p.update(Snapshot(rows_done=0, rows_committed=0, rows_in_flight=8, tokens=8 * step))
    drawn = stream.getvalue()
    assert "0/100" in drawn and "13 tok/s, 0 committed, 8 running, 0 read ahead" in drawn
    p.close()


def test_progress_by_bytes_counts_the_rows_in_flight_once_the_input_is_all_read():
    p = Progress(total_rows=None, rows_before=0, log_every=30, enabled=False, total_bytes=1000, clock=lambda: 0.0)
    line = p.line(Snapshot(rows_done=100, rows_committed=0, rows_in_flight=50, tokens=0, bytes_read=1000), now=10.0)
    assert line == "100/150 rows (66.7%), 10.0 rows/s, 0 tok/s, 0 committed, 50 running, 0 read ahead, ETA 5s"
    half = p.line(Snapshot(rows_done=100, rows_committed=0, rows_in_flight=50, tokens=0, bytes_read=500), now=10.0)
    assert half == "100/~300 rows (33.3%), 10.0 rows/s, 0 tok/s, 0 committed, 50 running, 0 read ahead, ETA 20s"  # 150 rows read per half


def test_a_rerun_of_a_job_whose_every_row_failed_fails_again_and_status_says_failed(tmp_path, model):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": ""} for _ in range(3)])  # every row: an empty prompt
    out = tmp_path / "out"
    first = run("--model", model, "--input", src, "--output", out, "--no-progress", code=1)
    assert "every row failed (3 of 3" in first.stderr
    again = run("--model", model, "--input", src, "--output", out, "--no-progress", code=1)  # cron, a retry loop
    assert "already finished, and every row failed (3 of 3" in again.stderr and "empty" in again.stderr
    status = CliRunner().invoke(main, ["status", str(out)])
    assert status.output.startswith(f"{out}: failed") and "every row failed" in status.output


def test_a_rerun_over_max_errors_fails_until_max_errors_is_raised(tmp_path, model):
    rows = [{"prompt": "" if i % 3 == 0 else f"row {i}"} for i in range(9)]  # 3 of 9 fail
    src, out = jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out"
    args = ("--model", model, "--input", src, "--output", out, "--max-tokens", 4, "--no-progress")
    run(*args, "--max-errors", "0.2", code=1)
    again = run(*args, "--max-errors", "0.2", code=1)
    assert "more than max_errors allows" in again.stderr
    assert "already finished" in run(*args, "--max-errors", "0.5").stdout


def test_a_jsonl_jobs_terminal_bar_counts_rows_of_the_rows_known_not_bytes_read():
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream, t = Tty(), [0.0]
    p = Progress(total_rows=None, rows_before=0, log_every=30, stream=stream, total_bytes=1000, clock=lambda: t[0])
    t[0] = 1.0  # the reader has buffered the whole (small) file at once: 10 rows done, 90 in the engine
    p.update(Snapshot(rows_done=10, rows_committed=0, rows_in_flight=90, tokens=500, bytes_read=1000))
    drawn = stream.getvalue()
    assert "10/100" in drawn and "input read" not in drawn and "500 tok/s, 0 committed, 90 running, 0 read ahead" in drawn
    p.close()


def test_ctrl_c_during_start_up_exits_130_with_one_line(tmp_path, model):
    import subprocess
    import sys
    import time

    src = tmp_path / "in.jsonl"
    os.mkfifo(src)  # a stream no writer has opened yet: the job waits in start-up until interrupted
    proc = subprocess.Popen([sys.executable, "-m", "batchjob.cli.main", "run", "--model", model, "--input", str(src),
                             "--output", str(tmp_path / "out"), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a shell
    while True:  # until the job opened the stream for reading (its start-up well under way), however busy the machine
        try:
            writer = os.open(src, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
            break
        except OSError:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    os.close(writer)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["batchjob: interrupted during start-up: nothing ran and nothing was written"]
    assert not (tmp_path / "out").exists()


def test_ctrl_c_after_the_final_commit_keeps_the_jobs_exit_code(tmp_path, model, monkeypatch):
    from batchjob.job.report.summary import JobSummary

    line = JobSummary.line

    def line_then_ctrl_c(self):
        os.kill(os.getpid(), signal.SIGINT)  # the operator presses Ctrl-C as the job prints its end
        return line(self)

    monkeypatch.setattr(JobSummary, "line", line_then_ctrl_c)
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(3)])
    try:
        result = run("--model", model, "--input", src, "--output", tmp_path / "out", "--max-tokens", 3, "--no-progress")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert "batchjob: finished: 3 rows" in result.stdout and "Aborted" not in result.output


def test_a_full_disk_is_said_once_and_status_says_where_it_stopped(tmp_path, model, monkeypatch):
    import errno

    parts = set()
    real = os.fsync

    def fsync_until_full(fd):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if "part-" in name:
            parts.add(name)
            if len(parts) > 2:  # the first two parts fit, the third does not
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr("batchjob.io.disk.os.fsync", fsync_until_full)
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(30)])
    out = tmp_path / "out"
    result = run("--model", model, "--input", src, "--output", out, "--max-tokens", 3, "--part-rows", 4,
                 "--max-num-seqs", 4, "--no-progress", code=1)
    assert result.stderr.count("No space left on device") == 1, result.stderr
    assert result.stderr.startswith("batchjob: ") or "\nbatchjob: error: cannot write" in result.stderr
    status = CliRunner().invoke(main, ["status", str(out)])
    assert Manifest.load(out).done_rows().count() == 8  # two parts of four rows
    assert status.output.startswith(f"{out}: stopped") and "stopped: disk full at row 8" in status.output, status.output


def test_results_keep_the_inputs_id_and_show_prints_each_prompt_beside_its_text(tmp_path, model, capsys):
    from batchjob.cli import show
    from batchjob.io.parts import read_results

    src = jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(4)])
    out = tmp_path / "out"
    run("--model", model, "--input", src, "--output", out, "--max-tokens", 3, "--no-progress")
    table = read_results(out).sort_by("row_index")
    assert table.column("id").to_pylist() == ["q0", "q1", "q2", "q3"] and "prompt" not in table.column_names
    assert show.main([str(out), "-n", "2"]) == 0
    shown = capsys.readouterr().out
    assert "[0]\n  prompt: question 0\n  -> " in shown and "[1]\n  prompt: question 1\n" in shown
    other = jsonl(tmp_path / "other.jsonl", [{"key": f"k{i}", "prompt": f"q {i}"} for i in range(2)])
    run("--model", model, "--input", other, "--output", tmp_path / "by-key", "--id-column", "key", "--max-tokens", 2,
        "--no-progress")
    assert read_results(tmp_path / "by-key").column("key").to_pylist() == ["k0", "k1"]
    run("--model", model, "--input", src, "--output", tmp_path / "no-id", "--id-column", "none", "--max-tokens", 2,
        "--no-progress")
    assert "id" not in read_results(tmp_path / "no-id").column_names


def test_the_final_line_counts_the_prompt_tokens_of_the_rows_that_ran(tmp_path, model):
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": "a short row"}, {"prompt": "word " * 3000}, {"prompt": "another row"}])
    out = tmp_path / "out"
    result = run("--model", model, "--input", src, "--output", out, "--max-tokens", 2, "--no-progress")
    rows = {r["row_index"]: r for p in out.glob("part-*.arrow") for r in pa.ipc.open_file(p).read_all().to_pylist()}
    assert rows[1]["error"] and rows[1]["prompt_tokens"] > 1024  # the refused row keeps its count in its row
    ran = rows[0]["prompt_tokens"] + rows[2]["prompt_tokens"]
    assert f"3 rows (1 errors), {ran} prompt tokens," in result.stdout, result.stdout


def test_a_repeated_list_flag_gives_all_its_values_and_replaces_the_job_files_list(tmp_path, model):
    """As vLLM's repeated --lora-modules entries: each use of a flag that names a list adds to it (comma-separated
    values and JSON lists as one use takes them); the list given by flags replaces the job file's."""
    src = jsonl(tmp_path / "in.jsonl", [{"prompt": "a b c", "id": "r0", "tag": "x", "note": "n"}])
    job = tmp_path / "job.toml"
    job.write_text(f'model = "{model}"\ninput = "{src}"\noutput = "{tmp_path / "out"}"\nkeep_columns = ["note"]\n'
                   '[sampling]\nmax_tokens = 2\nstop = ["from the file"]\n')
    run(job, "--stop-token-ids", "5,6", "--stop-token-ids", "7", "--stop", "x", "--stop", '["y,z"]',
        "--keep-columns", "id", "--keep-columns", "tag", "--no-progress")
    params = Manifest.load(tmp_path / "out").fingerprint["params"]
    assert params["stop_token_ids"] == [5, 6, 7] and params["stop"] == ["x", "y,z"]
    assert params["keep_columns"] == ["id", "tag"]  # the file's ["note"] is replaced, not added to
    run(job, "--output", tmp_path / "file", "--no-progress")  # no flag: the file's lists stand
    params = Manifest.load(tmp_path / "file").fingerprint["params"]
    assert params["stop"] == ["from the file"] and params["keep_columns"] == ["note"]
