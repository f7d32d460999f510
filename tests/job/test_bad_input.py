"""Every bad input the project knows, as an operator meets it: the exit code (0 done, 1 failed, 2 usage),
exactly one error line on stderr naming the file, flag or row, never a traceback, nothing left behind
by a run that could not start, and committed rows untouched by one that was refused."""
from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.lock import OutputLock
from batchjob.io.sink import ArrowSink

PROMPTS = [{"prompt": f"row {i} says hello"} for i in range(6)]


@dataclass
class Case:
    name: str
    args: Callable[[dict], list]  # env -> CLI arguments (after the command)
    code: int
    says: str  # the one error line contains this
    command: str = "run"
    setup: Callable[[dict], None] | None = None
    leaves_output: bool = False  # the output folder exists afterwards (refused on an existing output)
    also: list[str] = field(default_factory=list)  # more text the error line must contain


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_args(env, *extra, model=None, inp=None, out=None):
    return ["--model", model or env["model"], "--input", inp or env["input"], "--output", out or env["out"],
            "--max-tokens", "2", "--no-progress", *map(str, extra)]


def truncated_copy(src: Path, dst: Path, size: int) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    target = dst / "model.safetensors" if dst.is_dir() else dst
    data = target.read_bytes()
    target.write_bytes(data[:size])
    return dst


def commit_a_job(env):
    result = CliRunner().invoke(main, ["run", *run_args(env)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    env["committed"] = {p.name: p.read_bytes() for p in Path(env["out"]).iterdir() if p.name.startswith("part-")}


def hold_lock(env):
    env["lock"] = OutputLock(env["out"])


CASES = [
    # the model
    Case("truncated safetensors", lambda e: run_args(e, model=truncated_copy(e["model_dir"], e["tmp"] / "trunc", 4000)),
         1, "model.safetensors: not a readable safetensors file, probably truncated"),
    Case("GGUF of 1,000 bytes", lambda e: run_args(e, model=truncated_copy(e["gguf"], e["tmp"] / "short.gguf", 1000)),
         1, "short.gguf: the GGUF file is truncated or damaged", also=["1,000 bytes"]),
    Case("GGUF cut in its tensors", lambda e: run_args(e, model=truncated_copy(e["gguf"], e["tmp"] / "half.gguf",
                                                                             e["gguf"].stat().st_size // 2)),
         1, "half.gguf: the GGUF file is truncated or damaged"),
    Case("not a GGUF file", lambda e: run_args(e, model=write(e["tmp"] / "x.gguf", "hello")), 1, "x.gguf: not a GGUF file"),
    Case("no such model", lambda e: run_args(e, model=str(e["tmp"] / "nope")), 1, "nope': no such file or folder"),
    Case("pickle-only weights", lambda e: run_args(e, model=e["pickled"]), 1, "only in pickle format"),
    # flags and job files
    Case("negative --threads", lambda e: run_args(e, "--threads", -1), 2, "threads: must be >= 1"),
    Case("--top-p out of range", lambda e: run_args(e, "--top-p", 1.5), 2, "top_p: must be in (0, 1]"),
    Case("--device cuda without a GPU", lambda e: run_args(e, "--device", "cuda"), 2, "device: cuda was asked for"),
    Case("--chat-template missing", lambda e: run_args(e, "--chat-template", e["tmp"] / "none.jinja"), 2,
         "chat_template: cannot read", also=["none.jinja"]),
    Case("--chat-template does not compile", lambda e: run_args(e, "--chat", "--chat-template",
                                                                write(e["tmp"] / "bad.jinja", "{% if %}")),
         2, "bad.jinja: chat template does not compile"),
    Case("--output is a file", lambda e: run_args(e, out=write(e["tmp"] / "afile", "x")), 2, "afile is a file, not a folder"),
    Case("unknown job-file field", lambda e: [write(e["tmp"] / "j.toml", f'input = "{e["input"]}"\ntemperatur = 1\n')], 2,
         "unknown field 'temperatur'"),
    Case("two typos in a job file", lambda e: [write(e["tmp"] / "j.toml", f'input = "{e["input"]}"\ntemperatur = 1\n'
                                                                         '[engine]\nmax_num_seq = 4\n')], 2,
         "j.toml: unknown field 'temperatur' (did you mean 'temperature'?)",
         also=["unknown field 'engine.max_num_seq' (did you mean 'max_num_seqs'?)"]),
    Case("a field in another table", lambda e: [write(e["tmp"] / "j.toml", f'input = "{e["input"]}"\n[engine]\nmax_tokens = 4\n')],
         2, "j.toml: [engine] max_tokens: belongs in [sampling] (or at the top level), not in [engine]"),
    Case("a bad value in a job file", lambda e: [write(e["tmp"] / "j.toml", f'input = "{e["input"]}"\n[sampling]\ntop_p = 1.5\n')],
         2, "j.toml: top_p: must be in (0, 1]"),
    Case("--max-model-len 1", lambda e: run_args(e, "--max-model-len", 1), 2, "max_model_len: must be >= 2 tokens"),
    Case("job file is not TOML", lambda e: [write(e["tmp"] / "j.toml", "input = [\n")], 2, "j.toml: invalid TOML"),
    Case("job file without input", lambda e: [write(e["tmp"] / "j.toml", f'model = "{e["model"]}"\n')], 2,
         "input: no input given", also=["j.toml"]),
    Case("--kernels native on 8-token blocks", lambda e: run_args(e, "--kernels", "native", "--block-size", 8), 1,
         "kernels: 'native' cannot run here"),
    # the input
    Case("no such input (flag)", lambda e: run_args(e, inp=str(e["tmp"] / "none.jsonl")), 1,
         "input not found", also=["none.jsonl", "(--input)"]),
    Case("no such input (job file)", lambda e: [write(e["tmp"] / "j.toml", f'input = "{e["tmp"] / "gone.jsonl"}"\n'
                                                                          f'model = "{e["model"]}"\n')],
         1, "input not found", also=["gone.jsonl", "j.toml"]),
    Case("prompt column missing", lambda e: run_args(e, "--prompt-column", "text"), 1, "column 'text' not found"),
    Case("every row fails", lambda e: run_args(e, inp=write(e["tmp"] / "bad.jsonl", '{"prompt": ""}\n{"prompt": null}\n')),
         1, "every row failed (2 of 2", also=["row 0: column 'prompt' is empty"], leaves_output=True),
    Case("too many errors", lambda e: run_args(e, "--max-errors", 0, inp=write(e["tmp"] / "some.jsonl",
                                                                                '{"prompt": "ok"}\nnot json\n')),
         1, "max_errors", leaves_output=True),
    # an existing output
    Case("another job into a committed output", lambda e: run_args(e, "--temperature", 0.5), 1,
         "params.temperature: 0.0 -> 0.5", setup=commit_a_job, leaves_output=True),
    Case("an output another run holds", lambda e: run_args(e), 1, "is in use by process", setup=hold_lock,
         leaves_output=True),
    # export
    Case("export --to a folder", lambda e: [e["done"], "--to", e["tmp"]], 2, "is a directory", command="export",
         leaves_output=True),
    Case("export of a folder with rows missing", lambda e: [e["partial"], "--to", e["tmp"] / "x.parquet"], 1,
         "holds 3 rows, but the job has not read its input to the end", also=["--partial"], command="export",
         leaves_output=True),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir, tiny_gguf_path):
    tmp = tmp_path_factory.mktemp("bad_input")
    model_dir = tiny_model_dir("llama")
    pickled = tmp / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, pickled / name)
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"w": torch.zeros(1).numpy()}))
    inp = tmp / "in.jsonl"
    inp.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    done = tmp / "done"
    assert CliRunner().invoke(main, ["run", "--model", str(model_dir), "--input", str(inp), "--output", str(done),
                                     "--max-tokens", "2", "--no-progress"]).exit_code == 0
    partial = tmp / "partial"  # a JSONL job stopped after 3 rows (a --limit 3 run would be finished: its 3 rows)
    with ArrowSink(partial, fingerprint={"input": str(inp)}) as sink:
        sink.set_extra("run", {"state": "stopped", "signal": "SIGTERM", "started": 1.0, "ended": 2.0})
        for i in range(3):
            sink.write({"row_index": i, "generated_text": "x", "finish_reason": "stop", "prompt_tokens": 1,
                        "completion_tokens": 1, "error": None})
    return {"model": str(model_dir), "model_dir": model_dir, "gguf": tiny_gguf_path("llama"), "pickled": pickled,
            "input": str(inp), "done": str(done), "partial": str(partial)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_fails_in_one_clear_line(case, env, tmp_path):
    e = {**env, "tmp": tmp_path, "out": str(tmp_path / "out")}
    if case.setup:
        case.setup(e)
    try:
        result = CliRunner().invoke(main, [case.command, *map(str, case.args(e))])
    finally:
        if "lock" in e:
            e["lock"].release()
    stderr = result.stderr
    assert "Traceback" not in result.output and "Traceback" not in stderr
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == case.code, (result.exit_code, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith(("batchjob: error:", "Error:"))]
    assert len(errors) == 1, stderr
    assert case.says in errors[0] and all(t in errors[0] for t in case.also), errors[0]
    assert "internal error" not in errors[0]
    out = Path(e["out"])
    if not case.leaves_output:
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    if "committed" in e:  # refused: what was committed is as it was
        now = {p.name: p.read_bytes() for p in out.iterdir() if p.name.startswith("part-")}
        assert now == e["committed"]


def test_max_model_len_caps_each_row_and_a_longer_prompt_is_that_rows_error(env, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "word " * 40}) + "\n")
    out = tmp_path / "out"
    args = ["run", "--model", env["model"], "--input", str(src), "--output", str(out), "--max-tokens", "50",
            "--ignore-eos", "--no-progress"]
    result = CliRunner().invoke(main, [*args, "--max-model-len", "16"])
    assert result.exit_code == 0, result.stderr
    short, long = sorted(pa.concat_tables(pa.ipc.open_file(p).read_all() for p in out.glob("part-*.arrow")).to_pylist(),
                         key=lambda r: r["row_index"])
    assert short["finish_reason"] == "length" and short["prompt_tokens"] + short["completion_tokens"] == 16
    assert long["finish_reason"] == "error" and "at most 15 fit (the context is capped at max_model_len 16" in long["error"]
    again = CliRunner().invoke(main, [*args, "--max-model-len", "32"])  # other text: another job
    assert again.exit_code == 1 and "max_model_len" in again.stderr


def test_export_creates_the_folder_it_writes_into(env, tmp_path):
    to = tmp_path / "new" / "deeper" / "all.parquet"
    result = CliRunner().invoke(main, ["export", env["done"], "--to", str(to)])
    assert result.exit_code == 0, result.stderr
    assert pq.read_table(to).num_rows == len(PROMPTS)


def test_a_corrupt_parquet_row_group_fails_its_rows_and_the_job_goes_on(env, tmp_path):
    src = tmp_path / "in.parquet"
    rows = [f"prompt number {i}" for i in range(12)]
    pq.write_table(pa.table({"prompt": rows}), src, row_group_size=4, compression="none")
    meta = pq.ParquetFile(src).metadata
    at = meta.row_group(1).column(0).data_page_offset
    data = bytearray(src.read_bytes())
    data[at:at + 24] = b"\xff" * 24  # the second row group's page header: unreadable
    src.write_bytes(bytes(data))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", "--model", env["model"], "--input", str(src), "--output", str(out),
                                       "--max-tokens", "2", "--no-progress"])
    assert result.exit_code == 0, result.stderr
    assert "Traceback" not in result.stderr
    table = pa.concat_tables(pa.ipc.open_file(p).read_all() for p in sorted(out.glob("part-*.arrow")))
    by_row = {r["row_index"]: r for r in table.to_pylist()}
    assert sorted(by_row) == list(range(12))  # every row once
    bad = [i for i, r in by_row.items() if r["finish_reason"] == "error"]
    assert bad == [4, 5, 6, 7]
    assert all("row group 1" in by_row[i]["error"] and "in.parquet" in by_row[i]["error"] for i in bad)
