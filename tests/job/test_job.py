"""`batchjob run` end to end on a tiny model: output files, per-row errors, resume skip, lanes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from click.testing import CliRunner

from batchjob.io.manifest import Manifest

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from tests.builders import write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def run_cli(*args) -> str:
    result = CliRunner().invoke(main, ["run", *map(str, args), "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_run_writes_one_row_per_input_row_readable_by_pyarrow_and_pandas(tmp_path, model_dir):
    rows = [{"id": f"r{i}", "prompt": "Batch inference reads rows " * (i % 5 + 1)} for i in range(30)]
    rows[3]["prompt"] = ""  # empty prompt -> per-row error
    rows[7]["prompt"] = None  # null prompt -> per-row error
    rows[11]["prompt"] = "word " * 2000  # longer than the context -> per-row error
    rows[13]["prompt"] = 42  # wrong type
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    lines = src.read_text().splitlines()
    lines.insert(20, "{not json")  # unparseable line -> per-row error naming the line
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    printed = run_cli("--model", model_dir, "--input", src, "--output", out, "--max-tokens", 8, "--keep-columns", "id",
                      "--part-rows", 7)
    assert "31 rows (5 errors)" in printed
    parts = sorted(out.glob("part-*.arrow"))
    assert len(parts) >= 4
    tables = [ipc.open_file(p).read_all() for p in parts]
    table = pa.concat_tables(tables).sort_by("row_index")
    assert table.column("row_index").to_pylist() == list(range(31))
    assert table.schema.names == ["row_index", "generated_text", "finish_reason", "prompt_tokens", "completion_tokens", "error", "id",
                                 "error_code"]
    reasons = table.column("finish_reason").to_pylist()
    errors = table.column("error").to_pylist()
    assert {i for i, r in enumerate(reasons) if r == "error"} == {3, 7, 11, 13, 20}
    assert "empty" in errors[3] and "null" in errors[7] and "context" in errors[11] and "string" in errors[13]
    assert "line 21" in errors[20] and "invalid JSON" in errors[20]
    ok = [i for i, r in enumerate(reasons) if r != "error"]
    assert all(table.column("completion_tokens")[i].as_py() >= 1 for i in ok)
    assert all(r in ("stop", "length") for i, r in enumerate(reasons) if i in ok)
    pd = pytest.importorskip("pandas")
    df = pd.concat([pd.read_feather(p) for p in parts]).sort_values("row_index")
    assert len(df) == 31 and df["id"].iloc[0] == "r0"
    assert Manifest.load(out).num_rows() == 31


def test_rerun_skips_committed_rows_and_gives_the_same_text(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"The fox number {i} jumps"} for i in range(12)])
    out = tmp_path / "out"
    run_cli("--model", model_dir, "--input", src, "--output", out, "--max-tokens", 6, "--temperature", 0.8, "--seed", 3)
    first = read_results(out)
    printed = run_cli("--model", model_dir, "--input", src, "--output", out, "--max-tokens", 6, "--temperature", 0.8, "--seed", 3)
    assert "already finished: 12 rows" in printed  # everything was committed: nothing recomputed
    # a fresh run elsewhere gives the same sampled text row for row
    out2 = tmp_path / "out2"
    run_cli("--model", model_dir, "--input", src, "--output", out2, "--max-tokens", 6, "--temperature", 0.8, "--seed", 3)
    assert read_results(out2).column("generated_text").to_pylist() == first.column("generated_text").to_pylist()


def test_chat_messages_and_parquet_input(tmp_path, model_dir):
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": f"hello {i}"}] for i in range(5)]
    msgs.append([{"role": "user"}])  # no content -> per-row error
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    out = tmp_path / "out"
    printed = run_cli("--model", model_dir, "--input", tmp_path / "chat.parquet", "--output", out, "--max-tokens", 4)
    assert "6 rows (1 errors)" in printed
    t = read_results(out)
    assert t.column("prompt_tokens")[0].as_py() > 5  # the chat template (with its system message) was applied


def test_two_lanes_finish_every_row_and_interactive_waits_less(tmp_path, model_dir):
    bulk = write_jsonl(tmp_path / "bulk.jsonl", [{"prompt": f"Parquet files and rows {i} " * 3} for i in range(60)])
    inter = write_jsonl(tmp_path / "interactive.jsonl", [{"prompt": f"Hello {i}"} for i in range(15)])
    job = tmp_path / "lanes.toml"
    job.write_text(f"""
model = "{model_dir}"
output = "{tmp_path / 'out'}"
max_tokens = 12
ignore_eos = true
max_num_seqs = 4
read_ahead = 100             # every row is queued at the start: waits compare like for like
progress = false

[[lanes]]
name = "interactive"
priority = 10
input = "{inter}"

[[lanes]]
name = "bulk"
priority = 0
input = "{bulk}"
""")
    result = CliRunner().invoke(main, ["run", str(job)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(read_results(tmp_path / "out" / "interactive")) == 15
    assert len(read_results(tmp_path / "out" / "bulk")) == 60
    lines = [json.loads(line) for line in (tmp_path / "out" / "stats.jsonl").read_text().splitlines()]
    final = lines[-1]
    assert final["summary"] and final["lanes"]["interactive"]["rows"] == 15 and final["lanes"]["bulk"]["rows"] == 60
    assert final["lanes"]["interactive"]["mean_wait_s"] < final["lanes"]["bulk"]["mean_wait_s"]


def test_rows_choose_lanes_by_priority_column(tmp_path, model_dir):
    rows = [{"prompt": f"row {i}", "priority": 10 if i % 3 == 0 else 0} for i in range(12)]
    rows.append({"prompt": "bad", "priority": 5})  # no lane has priority 5 -> per-row error
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job = tmp_path / "lanes.toml"
    job.write_text(f"""
model = "{model_dir}"
input = "{src}"
output = "{tmp_path / 'out'}"
max_tokens = 4
[[lanes]]
name = "bulk"
priority = 0
[[lanes]]
name = "interactive"
priority = 10
weight = 2
""")
    result = CliRunner().invoke(main, ["run", str(job), "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    t = read_results(tmp_path / "out")
    lanes = t.column("lane").to_pylist()
    assert lanes[:12] == ["interactive" if i % 3 == 0 else "bulk" for i in range(12)]
    assert t.column("finish_reason")[12].as_py() == "error" and "priority 5" in t.column("error")[12].as_py()


def test_job_level_errors_exit_1_and_usage_errors_2_with_a_clear_message(tmp_path, model_dir):
    runner = CliRunner()
    r = runner.invoke(main, ["run", "--model", str(model_dir), "--input", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 1 and "missing.jsonl" in r.output
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    r = runner.invoke(main, ["run", "--model", str(model_dir), "--input", str(src), "--output", str(tmp_path / "o")])
    assert r.exit_code == 1 and "'prompt'" in r.output and "text" in r.output  # names the column and the available ones
    r = runner.invoke(main, ["run", "--model", str(tmp_path / "nope"), "--input", str(src), "--prompt-column", "text",
                             "--output", str(tmp_path / "o-nope")])
    assert r.exit_code == 1 and "nope" in r.output
    assert not (tmp_path / "o-nope").exists()  # a mistyped model leaves no output folder behind
    bad = tmp_path / "bad.toml"
    bad.write_text('input = "x.jsonl"\nmax_tokenz = 3\n')
    r = runner.invoke(main, ["run", str(bad)])
    assert r.exit_code == 2 and "max_tokenz" in r.output  # a usage error, as click reports its own


def test_console_script_help_documents_the_fields():
    out = subprocess.run([sys.executable, "-m", "batchjob.cli.main", "run", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0
    for flag in ("--model", "--input", "--output", "--prompt-column", "--messages-column", "--max-tokens",
                 "--temperature", "--seed", "--scheduling", "--keep-columns", "--chat", "--dtype"):
        assert flag in out.stdout
