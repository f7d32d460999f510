"""`batchjob status` and `batchjob export` on finished, running, stopped, killed, per-lane and sharded folders."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.engine.worker.model_runner import ModelRunner
from batchjob.io import merge as merge_module
from batchjob.io.export import ExportError, export
from batchjob.io.manifest import Manifest
from batchjob.io.parts import read_results
from batchjob.io.sink import ArrowSink
from batchjob.io.folder_status import status
from batchjob.io.sizes import format_bytes
from batchjob.job import run as run_module

FP = {"model": "tiny", "input": "data.jsonl"}
FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress"]
MACHINE_MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plausible_rss(n) -> bool:
    return isinstance(n, int) and 16 << 20 < n < MACHINE_MEMORY  # more than an empty interpreter, less than the machine


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*map(str, args)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def result(i, **kept):
    return {"row_index": i, "generated_text": f"answer {i}", "finish_reason": "error" if i % 10 == 9 else "stop",
            "prompt_tokens": 3, "completion_tokens": 2, "error": "bad row" if i % 10 == 9 else None, **kept}


def folder_of(tmp_path, order, total, part_rows=7, **kept_of) -> Path:
    out = tmp_path / "out"
    with ArrowSink(out, fingerprint=FP, keep_columns=list(kept_of), part_rows=part_rows, total_rows=total) as sink:
        for i in order:
            sink.write(result(i, **{k: f(i) for k, f in kept_of.items()}))
    return out


# export


def test_export_merges_parts_in_input_order_into_each_format(tmp_path):
    order = [5, 0, 3, 1, 2, 4, 9, 7, 8, 6, *range(10, 100)]
    order[40:50] = reversed(order[40:50])
    out = folder_of(tmp_path, order, 100, score=lambda i: None if i < 7 else (i if i < 50 else i + 0.5),
                    tag=lambda i: i if i < 30 else f"t{i}")  # kept columns whose type changes across parts
    expected = read_results(out)
    for suffix in (".parquet", ".arrow", ".jsonl"):
        to = tmp_path / f"all{suffix}"
        assert "100 rows" in cli("export", out, "--to", to)
        if suffix == ".parquet":
            table = pq.read_table(to)
        elif suffix == ".arrow":
            table = ipc.open_file(to).read_all()
        else:
            table = pa.Table.from_pylist([json.loads(line) for line in to.read_text().splitlines()])
        assert table.column("row_index").to_pylist() == list(range(100))
        assert table.column("generated_text").to_pylist() == expected.column("generated_text").to_pylist()
        assert table.column("score").to_pylist() == expected.column("score").to_pylist()
        assert table.column("tag").to_pylist() == expected.column("tag").to_pylist()  # as text: int then str
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_export_refuses_when_rows_are_missing_and_says_which(tmp_path):
    out = folder_of(tmp_path, [i for i in range(40) if not 10 <= i < 15 and i != 33], 40)
    printed = cli("export", out, "--to", tmp_path / "x.parquet", code=1)
    assert "lacks 6 of 40 rows: 10-14, 33" in printed and "--partial" in printed
    assert not (tmp_path / "x.parquet").exists()
    printed = cli("export", out, "--to", tmp_path / "x.parquet", "--partial")
    assert "34 rows" in printed and "6 rows missing: 10-14, 33" in printed
    assert pq.read_table(tmp_path / "x.parquet").num_rows == 34
    with ArrowSink(tmp_path / "open", fingerprint=FP) as sink:  # a JSONL job that never reached its input's end
        sink.write(result(0))
    assert "unknown" in cli("export", tmp_path / "open", "--to", tmp_path / "y.jsonl", code=1)
    assert "bad.csv" in cli("export", out, "--to", tmp_path / "bad.csv", code=1)
    (tmp_path / "empty").mkdir()
    assert "not a batchjob output folder" in cli("export", tmp_path / "empty", "--to", tmp_path / "z.jsonl", code=1)


def test_export_is_atomic(tmp_path, monkeypatch):
    out = folder_of(tmp_path, range(50), 50, part_rows=5)
    to = tmp_path / "results.parquet"
    to.write_bytes(b"the previous export")
    conform = merge_module.conform
    calls = [0]

    def fail_on_second_chunk(table, schema):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device")
        return conform(table, schema)

    monkeypatch.setattr(merge_module, "conform", fail_on_second_chunk)
    with pytest.raises(OSError):
        export(out, to, chunk_rows=10)
    assert to.read_bytes() == b"the previous export"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "results.parquet"]  # no temp file left


def test_export_holds_a_few_parts_at_a_time(tmp_path, monkeypatch):
    # 2,000 rows in 200 parts of 10, completed roughly in order, with a straggler now and then
    order = list(range(2000))
    for k in range(0, 2000, 97):
        order.append(order.pop(k))  # row k finishes late: its part spans far
    out = folder_of(tmp_path, order, 2000, part_rows=10)
    opened, closed, most = [0], [0], [0]
    init, close = merge_module._Part.__init__, merge_module._Part.close

    def counting_init(self, path):
        init(self, path)
        opened[0] += 1
        most[0] = max(most[0], opened[0] - closed[0])

    def counting_close(self):
        closed[0] += 1
        close(self)

    monkeypatch.setattr(merge_module._Part, "__init__", counting_init)
    monkeypatch.setattr(merge_module._Part, "close", counting_close)
    done = export(out, tmp_path / "all.arrow", chunk_rows=64)
    assert done.rows == 2000 and opened[0] == 200
    assert most[0] <= 4
    assert ipc.open_file(tmp_path / "all.arrow").read_all().column("row_index").to_pylist() == list(range(2000))


def test_export_refuses_duplicate_rows_across_parts(tmp_path):
    out = folder_of(tmp_path, range(10), 10, part_rows=5)
    manifest = Manifest.load(out)
    manifest.parts[1].rows = [[4, 9]]  # claims rows another part holds (a hand-edited folder)
    (out / "part-00001.arrow").write_bytes((out / "part-00000.arrow").read_bytes())
    with pytest.raises(ExportError, match="more than one part"):
        list(merge_module.merge_parts(out, manifest.parts, 100))


# status


def test_status_of_a_finished_job(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(20)] + [{"prompt": ""}])
    out = tmp_path / "out"
    cli("run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 4, *FAST)
    st = json.loads(cli("status", out, "--json"))
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 21 and st["errors"] == 1
    assert st["completion_tokens"] > 0 and st["prompt_tokens"] > 0 and st["eta_s"] is None
    assert st["folders"][0]["pid"] is None and st["last_commit"] > 0
    printed = cli("status", out)
    assert "finished, 21/21 rows (100.0%), 1 errors" in printed and "last commit" in printed
    export_to = tmp_path / "r.jsonl"
    cli("export", out, "--to", export_to)
    assert [json.loads(line)["row_index"] for line in export_to.read_text().splitlines()] == list(range(21))


def test_a_job_records_its_peak_rss_in_its_summary_and_status_shows_it(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(6)])
    out = tmp_path / "out"
    # no --kv-cache-gb: the pool is what 4 rows of the model's context (1,024 tokens) fill, and the start line says so
    said = cli("run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 3, "--max-num-seqs", 4,
               "--no-progress")
    assert "(4 rows x 1,024 tokens: --max-num-seqs x the model's context; --kv-cache-gb to set)" in said
    summary = json.loads((out / "stats.jsonl").read_text().splitlines()[-1])
    assert summary["summary"] and plausible_rss(summary["peak_rss_bytes"])
    assert f"peak RSS {format_bytes(summary['peak_rss_bytes'])}) -> {out}" in said  # the final line
    recorded = Manifest.load(out).extra["run"]["peak_rss_bytes"]
    # the manifest's run record is part of the last commit, the summary is taken after it: a peak only grows
    assert plausible_rss(recorded) and recorded <= summary["peak_rss_bytes"]
    st = json.loads(cli("status", out, "--json"))
    assert st["peak_rss_bytes"] == st["folders"][0]["peak_rss_bytes"] == recorded
    assert f"  peak RSS: {format_bytes(recorded)} in the last run" in cli("status", out)


def test_status_of_folders_written_before_peak_rss_was_kept_shows_none_and_no_error(tmp_path):
    bare = folder_of(tmp_path, range(10), 10)  # no run record at all
    with ArrowSink(tmp_path / "older", fingerprint=FP, total_rows=3) as sink:  # a run record without the field
        sink.set_extra("run", {"pid": 1, "host": "h", "started": 1.0, "ended": 2.0, "state": "finished",
                               "rows_at_start": 0, "completion_tokens_at_start": 0})
        for i in range(3):
            sink.write(result(i))
    for out in (bare, tmp_path / "older"):
        st = status(out)
        assert st["state"] == "finished" and st["peak_rss_bytes"] is None and st["folders"][0]["peak_rss_bytes"] is None
        printed = cli("status", out)
        assert "finished" in printed and "peak RSS" not in printed


def test_status_while_running_then_stopped_then_killed(tmp_path, model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i} of many"} for i in range(64)])
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 6, "--ignore-eos",
            "--max-num-seqs", 8, "--part-rows", 4, *FAST]
    seen = {}
    run = ModelRunner.run
    calls = [0]

    def look_then_stop(self, step):
        calls[0] += 1
        if calls[0] == 20:
            seen["running"] = status(out)
            seen["text"] = CliRunner().invoke(main, ["status", str(out)]).output
            seen["export"] = CliRunner().invoke(main, ["export", str(out), "--to", str(tmp_path / "now.jsonl"), "--partial"])
            seen["after_export"] = status(out)  # the writer thread may commit parts meanwhile
            os.kill(os.getpid(), signal.SIGTERM)
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", look_then_stop)
    monkeypatch.setattr(run_module, "PEAK_RSS_EVERY", 0.0)  # the peak so far at every step, stored with each part
    cli(*args, code=75)
    st = seen["running"]
    assert st["state"] == "running" and st["folders"][0]["pid"] == os.getpid()
    assert plausible_rss(st["peak_rss_bytes"]) and "peak RSS: " in seen["text"] and "so far (as of the last commit)" in seen["text"]
    assert 0 < st["rows_done"] < 64 and st["rows_per_s"] > 0 and st["eta_s"] is not None and st["eta_s"] > 0
    assert "running" in seen["text"] and "ETA" in seen["text"] and f"process {os.getpid()}" in seen["text"]
    assert seen["export"].exit_code == 0, seen["export"].output  # the committed rows of a running job
    exported = [json.loads(line)["row_index"] for line in (tmp_path / "now.jsonl").read_text().splitlines()]
    assert exported == sorted(exported) and st["rows_done"] <= len(exported) <= seen["after_export"]["rows_done"]

    st = status(out)
    assert st["state"] == "stopped" and "SIGTERM" in st["folders"][0]["note"]
    # a JSONL input not read to its end: the total is estimated from the bytes read so far
    assert st["total_rows"] is None and 48 <= st["total_estimate"] <= 80 and st["eta_s"] is None
    assert "about" in cli("status", out)
    assert "unknown" in cli("export", out, "--to", tmp_path / "x.parquet", code=1)

    class Killed(BaseException):
        pass

    calls[0] = 0

    def killed_at_the_fourth_step(self, step):
        calls[0] += 1
        if calls[0] == 4:
            raise Killed  # like SIGKILL: no handler, no last commit
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", killed_at_the_fourth_step)
    with pytest.raises(Killed):
        CliRunner().invoke(main, list(map(str, args)), catch_exceptions=False)
    st = status(out)
    assert st["state"] == "killed" and "rerun" in st["folders"][0]["note"]
    monkeypatch.undo()
    cli(*args)
    assert status(out)["state"] == "finished"


def test_status_and_export_of_per_lane_folders_and_a_lane_column(tmp_path, model_dir):
    bulk = write_jsonl(tmp_path / "bulk.jsonl", [{"prompt": f"bulk {i}"} for i in range(12)])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": f"chat {i}"} for i in range(5)])
    job = tmp_path / "lanes.toml"
    job.write_text(f'model = "{model_dir}"\noutput = "{tmp_path / "out"}"\nmax_tokens = 3\nkv_cache_gb = 0.02\nswap_space_gb = 0.01\n'
                   f'progress = false\n[[lanes]]\nname = "chat"\npriority = 5\ninput = "{chat}"\n'
                   f'[[lanes]]\nname = "bulk"\ninput = "{bulk}"\n')
    cli("run", job)
    st = status(tmp_path / "out")
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 17
    assert {f["folder"]: f["rows_done"] for f in st["folders"]} == {"bulk": 12, "chat": 5}
    printed = cli("status", tmp_path / "out")
    assert "bulk" in printed and "chat" in printed
    printed = cli("export", tmp_path / "out", "--to", tmp_path / "x.parquet", code=1)
    assert "several result folders (bulk, chat)" in printed
    cli("export", tmp_path / "out" / "chat", "--to", tmp_path / "chat.parquet")
    assert pq.read_table(tmp_path / "chat.parquet").num_rows == 5

    rows = [{"prompt": f"row {i}", "lane": "chat" if i % 3 == 0 else "bulk"} for i in range(12)]
    src = write_jsonl(tmp_path / "mixed.jsonl", rows)
    job.write_text(f'model = "{model_dir}"\ninput = "{src}"\noutput = "{tmp_path / "mixed"}"\nmax_tokens = 3\n'
                   f'kv_cache_gb = 0.02\nswap_space_gb = 0.01\nprogress = false\n[[lanes]]\nname = "chat"\npriority = 5\n'
                   f'[[lanes]]\nname = "bulk"\n')
    cli("run", job)
    st = status(tmp_path / "mixed")
    assert st["lanes"] == {"chat": {"rows": 4, "errors": 0}, "bulk": {"rows": 8, "errors": 0}}
    assert "lanes: bulk 8 rows (0 errors), chat 4 rows (0 errors)" in cli("status", tmp_path / "mixed")


def test_status_and_export_of_a_sharded_job(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(30)])
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 3, *FAST]
    cli(*args, "--shard", "1/2")
    st = json.loads(cli("status", out, "--json"))
    assert st["rows_done"] == 15 and st["total_rows"] == 30 and st["state"] == "stopped"
    assert "lacks" in cli("export", out, "--to", tmp_path / "x.parquet", code=1)
    shard = out / "shard-00001-of-00002"
    one = status(shard)  # a shard's own folder: its slice of the input, with global row indices
    assert one["state"] == "finished" and one["rows_done"] == one["total_rows"] == 15
    cli("export", shard, "--to", tmp_path / "shard1.jsonl")
    assert [json.loads(x)["row_index"] for x in (tmp_path / "shard1.jsonl").read_text().splitlines()] == list(range(15, 30))
    cli(*args, "--shard", "0/2")
    st = json.loads(cli("status", out, "--json"))
    assert st["state"] == "finished" and st["rows_done"] == 30
    peaks = [f["peak_rss_bytes"] for f in st["shard_states"]]  # each shard's own run
    assert all(map(plausible_rss, peaks))
    printed = cli("status", out)
    assert "peak RSS" in printed and all(format_bytes(peak) in printed for peak in peaks)
    assert "30 rows" in cli("export", out, "--to", tmp_path / "all.parquet")
    assert pq.read_table(tmp_path / "all.parquet").column("row_index").to_pylist() == list(range(30))


# a trial run (--limit N): its first N rows are the job, for status and export


def test_a_limit_run_exports_its_first_rows_and_status_counts_them_as_the_total(tmp_path, model_dir):
    # short rows first: a byte-based estimate from the first 10 rows would promise more rows than the file has
    rows = [{"prompt": f"Row {i}"} for i in range(10)] + [{"prompt": f"Row {i} " + "and more " * 20} for i in range(10, 40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = ["run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 3, "--part-rows", 4, *FAST]
    cli(*args, "--limit", 10)
    assert Manifest.load(out).extra["run"]["limit"] == 10
    st = json.loads(cli("status", out, "--json"))
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 10 and st["total_estimate"] is None
    printed = cli("status", out)
    assert "finished, 10/10 rows (100.0%)" in printed and "--limit 10" in printed and "about" not in printed
    done = export(out, tmp_path / "x.parquet")
    assert done.rows == done.total_rows == 10 and "--limit 10" in done.note and "rows 0-9" in done.note
    assert pq.read_table(tmp_path / "x.parquet").column("row_index").to_pylist() == list(range(10))
    assert "ran with --limit 10" in cli("export", out, "--to", tmp_path / "x.jsonl")  # the CLI says what it holds
    assert [json.loads(line)["row_index"] for line in (tmp_path / "x.jsonl").read_text().splitlines()] == list(range(10))
    cli(*args)  # without --limit: the rest of the input, and the job is the whole file again
    assert "limit" not in Manifest.load(out).extra["run"]
    st = json.loads(cli("status", out, "--json"))
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 40
    done = export(out, tmp_path / "all.parquet")
    assert done.rows == 40 and done.note is None
    assert pq.read_table(tmp_path / "all.parquet").column("row_index").to_pylist() == list(range(40))


def test_a_limit_run_larger_than_the_input_is_the_whole_input(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"Row {i}"} for i in range(6)])
    out = tmp_path / "out"
    cli("run", "--model", model_dir, "--input", src, "--output", out, "--max-tokens", 2, "--limit", 50, *FAST)
    st = json.loads(cli("status", out, "--json"))
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 6
    done = export(out, tmp_path / "x.jsonl")
    assert done.rows == 6 and done.note is None


def limited_folder(tmp_path, rows, limit, total=None, state="finished") -> Path:
    out = tmp_path / "out"
    with ArrowSink(out, fingerprint=FP, part_rows=4, total_rows=total) as sink:
        sink.set_extra("run", {"state": state, "started": 1.0, "ended": 2.0, **({"limit": limit} if limit else {})})
        for i in rows:
            sink.write(result(i))
    return out


def test_export_of_an_unfinished_limit_run_is_refused_and_names_the_missing_rows(tmp_path):
    out = limited_folder(tmp_path, [0, 1, 2, 5], 8, state="stopped")
    printed = cli("export", out, "--to", tmp_path / "x.parquet", code=1)
    assert "lacks 4 of 8 rows: 3-4, 6-7" in printed and not (tmp_path / "x.parquet").exists()
    st = status(out)
    assert st["total_rows"] == 8 and st["state"] == "stopped" and st["folders"][0]["missing"] == [[3, 5], [6, 8]]
    done = export(out, tmp_path / "x.parquet", partial=True)
    assert done.rows == 4 and done.missing.count() == 4


def test_a_limit_never_makes_the_total_exceed_a_known_input(tmp_path):
    out = limited_folder(tmp_path, range(5), 8, total=5)
    st = status(out)
    assert st["state"] == "finished" and st["total_rows"] == 5 and st["folders"][0]["note"] is None
    done = export(out, tmp_path / "x.jsonl")
    assert done.rows == done.total_rows == 5 and done.note is None


def test_rows_past_the_limit_from_an_earlier_run_count_too(tmp_path):
    out = limited_folder(tmp_path, range(12), 5)  # an earlier run went further than this --limit 5 run
    st = status(out)
    assert st["state"] == "finished" and st["rows_done"] == st["total_rows"] == 12
    done = export(out, tmp_path / "x.jsonl")
    assert done.rows == 12 and "rows 0-11" in done.note


def test_a_folder_without_a_recorded_limit_reads_as_before(tmp_path):
    out = limited_folder(tmp_path, range(5), None)  # an older manifest: no limit in its run record
    with pytest.raises(ExportError, match="not read its input to the end"):
        export(out, tmp_path / "x.jsonl")
    assert status(out)["total_rows"] is None


@pytest.mark.parametrize("command", [["status"], ["export", "--to", "x.jsonl"], ["show"], ["verify"]])
def test_a_missing_or_file_folder_is_one_line_naming_it_and_exit_1_for_every_command(tmp_path, command):
    missing, file = tmp_path / "nothing", tmp_path / "file.txt"
    file.write_text("not a folder")
    name, *rest = command
    result = CliRunner().invoke(main, [name, str(missing), *rest])
    assert (result.exit_code, result.output) == (
        1, f"batchjob: error: {missing}: no such folder; name a job's output folder (its --output)\n")
    result = CliRunner().invoke(main, [name, str(file), *rest])
    assert (result.exit_code, result.output) == (
        1, f"batchjob: error: {file} is a file; name a job's output folder (its --output)\n")


@pytest.mark.parametrize("fmt", ["rows", "openai-batch"])
@pytest.mark.parametrize("to, says", [
    ("/proc/x.jsonl", "cannot write /proc/x.jsonl: No such file or directory"),  # a folder no file can be made in
    ("/etc/hostname/x.jsonl", "--to /etc/hostname/x.jsonl: /etc/hostname is a file, not a folder"),
])
def test_export_to_a_place_that_cannot_be_written_is_one_line_and_exit_1(tmp_path, to, says, fmt):
    """The real command in its own process: one line on stderr, no traceback (the cleanup after the failed write
    does not raise again). Both places refuse root as well, so the test holds for any user."""
    with ArrowSink(tmp_path / "out", fingerprint={**FP, "model": {"path": "tiny"}}, total_rows=10) as sink:
        for i in range(10):
            sink.write(result(i))
    done = subprocess.run([sys.executable, "-m", "batchjob", "export", str(tmp_path / "out"), "--to", to, "--format", fmt],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"batchjob: error: {says}") and done.stderr.count("\n") == 1, done.stderr
    assert "free space" not in done.stderr  # not a full disk: the line says to choose another place


def test_export_to_a_full_disk_says_to_free_space(tmp_path):
    from batchjob.io.disk import Disk, using

    class Full(Disk):
        def write(self, fd, data, offset=None):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = folder_of(tmp_path, range(10), 10)
    with using(Full()):
        printed = cli("export", out, "--to", tmp_path / "x.parquet", code=1)
    assert printed == (f"batchjob: error: cannot write {tmp_path / 'x.parquet'}: No space left on device; nothing was "
                       "written under that name: free space and run the export again\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
