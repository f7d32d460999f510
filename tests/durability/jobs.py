"""The jobs the durability tests record: a job of several parts, a resumed job, a sharded job, an export and
an OpenAI Batch output, each with the check of a recovered folder (tests/durability/harness.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq

from tests.durability.harness import Scenario, check_folder, cli, result_texts

# one thread a job: the sweeps check their states in one forked copy of the test per core (tests/durability/forked.py)
FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress", "--dtype", "float32", "--threads", "1"]
ROWS = int(os.environ.get("BATCHJOB_CRASH_ROWS", "20"))  # make crash: more rows, parts and compactions
CHAT = "/v1/chat/completions"


def job(model, src, *extra, out="out"):
    return lambda root: ["run", "--model", model, "--input", src, "--output", root / out, "--max-tokens", 4,
                         "--part-rows", 5, *FAST, *extra]


def responses(path: Path) -> list:
    """The response lines without their `created` times (the one field a rerun changes)."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "created"}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return [strip(json.loads(line)) for line in path.read_text().splitlines()]


def scenarios(model, inputs, reference) -> list[Scenario]:
    prompts, batch = inputs
    texts, answers = reference
    half = len(texts) // 2

    def check_out(root: Path) -> None:
        check_folder(root / "out", texts, root / "check.parquet")

    def check_shards(root: Path) -> None:
        got = result_texts(root / "out" / "shard-00000-of-00002") + result_texts_offset(root / "out" / "shard-00001-of-00002", half)
        assert got == texts, "the shards' texts differ"
        verify = cli(["verify", root / "out"], code=None)
        assert verify.exit_code == 0, verify.output
        cli(["export", root / "out", "--to", root / "check.parquet"])
        assert pq.read_table(root / "check.parquet").column("generated_text").to_pylist() == texts

    def check_export(root: Path) -> None:
        assert pq.read_table(root / "exported" / "all.parquet").column("generated_text").to_pylist() == texts

    def check_batch(root: Path) -> None:
        assert responses(root / "batch" / "results.jsonl") == answers, "the response file differs"
        assert (root / "batch" / "errors.jsonl").read_bytes() == b""
        verify = cli(["verify", root / "batch"], code=None)
        assert verify.exit_code == 0, verify.output

    export = lambda root: ["export", root / "out", "--to", root / "exported" / "all.parquet"]  # noqa: E731
    return [
        Scenario("a job of several parts", [job(model, prompts)], check_out),
        Scenario("a resumed job", [job(model, prompts)], check_out, before=[job(model, prompts, "--limit", 7)],
                 prepare=torn_log),
        Scenario("a sharded job", [job(model, prompts, "--shard", "0/2"), job(model, prompts, "--shard", "1/2")],
                 check_shards),
        Scenario("an export", [export], check_export, before=[job(model, prompts)],
                 acked_files=["exported/all.parquet"]),
        Scenario("an OpenAI Batch output", [job(model, batch, "--output-format", "openai-batch", out="batch")],
                 check_batch, acked_files=["batch/results.jsonl", "batch/errors.jsonl"]),
    ]


def torn_log(root: Path) -> None:
    """The first run's last commit-log append cut short, as a crash in mid-append leaves it: the resume cuts
    it off before it appends."""
    with open(root / "out" / "commits.log", "ab") as f:
        f.write(b'{"sha256":"0123456789abcdef0123456789abcdef","record":{"seq":99,"ext')


def result_texts_offset(out: Path, start: int) -> list[str]:
    from batchjob.io.parts import read_results

    table = read_results(out)
    rows = table.column("row_index").to_pylist()
    assert sorted(rows) == list(range(start, start + len(rows))), f"rows {sorted(rows)}"
    by_row = dict(zip(rows, table.column("generated_text").to_pylist()))
    return [by_row[r] for r in sorted(rows)]


