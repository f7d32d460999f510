"""Sharding without Slurm: the plan, each format's slice, OUT/job.json checks, and merged shards == one run."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.job.options.config import ConfigError
from batchjob.io.ranges import RowRanges
from batchjob.io.parts import read_results
from batchjob.io.sources import DatasetsSource, ParquetSource, open_source
from batchjob.sharding.shards import JobFile, ShardError, ShardSource, ShardSpec, claim_shard, cut_points, plan_shards
from batchjob.sharding.sharded_output import shard_states

N = 103
RECORDS = [{"id": f"r{i}", "prompt": f"The fox number {i} jumps over " + "the dog " * (i % 4)} for i in range(N)]


def write_jsonl(path, lines):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return path


def slices(source, count):
    return [ShardSource(source, ShardSpec(k, count), r) for k, r in enumerate(plan_shards(source, count))]


def rows_of(source, **kw):
    return [(r.row_index, r.record, r.error) for r in source.rows(**kw)]


# ---- the plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("total,count", [(0, 3), (2, 4), (10, 1), (103, 4), (1000, 7)])
def test_cuts_cover_every_row_once_in_order(total, count):
    cuts = cut_points(total, count, [])
    assert cuts[0] == 0 and cuts[-1] == total and len(cuts) == count + 1
    assert cuts == sorted(cuts)
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    assert max(sizes) - min(sizes) <= 1


def test_cuts_move_to_row_group_starts_only_when_that_keeps_shards_even():
    # row groups of 30 rows: a cut near a group start moves there, one far from any stays even
    assert cut_points(240, 4, list(range(0, 240, 30))) == [0, 60, 120, 180, 240]
    assert cut_points(200, 4, list(range(0, 200, 30))) == [0, 60, 90, 150, 200]
    # one huge group: cuts cannot align without starving a shard
    assert cut_points(200, 4, [0, 190]) == [0, 50, 100, 150, 200]


def test_jsonl_shards_seek_to_their_rows_and_stop_at_their_end(tmp_path, monkeypatch):
    lines = [json.dumps(r) for r in RECORDS]
    lines.insert(10, "")  # blank lines are not rows
    lines.insert(40, "   ")
    lines.insert(55, "{not json")  # a bad line is still a row (an error row)
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())  # BOM, no final newline
    whole = rows_of(open_source(path))
    assert len(whole) == N + 1
    read_from = []
    original = type(open_source(path)).rows

    def spying(self, skip=None, *, columns=None, start_offset=None):
        read_from.append(start_offset)
        return original(self, skip, columns=columns, start_offset=start_offset)

    monkeypatch.setattr(type(open_source(path)), "rows", spying)
    shards = slices(open_source(path), 4)
    got = [rows_of(s) for s in shards]
    assert [len(g) for g in got] == [26, 26, 26, 26]
    # the same rows; a bad line's error cites a byte offset instead of a line number after a seek
    assert [(i, rec, err is None) for i, rec, err in sum(got, [])] == [(i, rec, err is None) for i, rec, err in whole]
    assert [offset[0] for offset in read_from] == [0, 26, 52, 78]
    assert all(offset[1] > 0 for offset in read_from[1:])  # a byte offset: no shard reads from the top
    # a resume point inside a shard wins over the shard's start; position() stays inside the shard
    third = shards[2]
    list(third.rows())
    assert third.position()[0] == 78
    resumed = rows_of(third, skip=RowRanges([(52, 60)]), start_offset=(60, _offset_of(path, 60)))
    assert [r[0] for r in resumed] == list(range(60, 78))


def test_more_shards_than_rows_leaves_some_empty(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    got = [[r.row_index for r in s.rows()] for s in slices(open_source(path), 4)]
    assert got == [[0], [], [1], []]


def _offset_of(path, row):
    source = open_source(path)
    for i, _ in enumerate(source.rows()):
        if i == row - 1:
            return source.position()[1]


def test_parquet_shards_read_only_their_row_groups(tmp_path, monkeypatch):
    folder = tmp_path / "pq"
    folder.mkdir()
    table = pa.Table.from_pylist(RECORDS[:100])
    pq.write_table(table.slice(0, 50), folder / "a.parquet", row_group_size=25)
    pq.write_table(table.slice(50, 50), folder / "b.parquet", row_group_size=25)
    reads, opened = [], []
    original = ParquetSource._read_row_group
    monkeypatch.setattr(ParquetSource, "_read_row_group",
                        lambda self, pf, i, cols: reads.append(i) or original(self, pf, i, cols))
    real_file = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda path, *a, **k: opened.append(path.name) or real_file(path, *a, **k))
    source = open_source(folder)
    shards = slices(source, 4)
    assert [(s.range.start, s.range.end) for s in shards] == [(0, 25), (25, 50), (50, 75), (75, 100)]
    assert [r["id"] for r in (x.record for x in shards[3].rows())] == [f"r{i}" for i in range(75, 100)]
    assert opened == ["b.parquet"] and reads == [1]  # one row group of one file


def test_datasets_shards_align_to_files(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"prompt": [r["prompt"] for r in RECORDS[:90]]})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    source = open_source(tmp_path / "ds")
    opened = []
    original = DatasetsSource._open
    monkeypatch.setattr(DatasetsSource, "_open", lambda self, f: opened.append(f.name) or original(self, f))
    shards = slices(source, 3)
    assert [(s.range.start, s.range.end) for s in shards] == [(0, 30), (30, 60), (60, 90)]
    assert [r.row_index for r in shards[1].rows()] == list(range(30, 60))
    assert opened == [source.files[1].name]


def test_shard_comes_from_the_slurm_array_task():
    env = {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert ShardSpec.resolve(None, env) == ShardSpec(2, 4)
    assert ShardSpec.resolve(None, {**env, "SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_STEP": "2",
                                    "SLURM_ARRAY_TASK_COUNT": "3"}) == ShardSpec(2, 3)
    assert ShardSpec.resolve("1/3", env) == ShardSpec(1, 3)  # the flag wins
    assert ShardSpec.resolve("none", env) is None
    assert ShardSpec.resolve(None, {}) is None
    assert ShardSpec(3, 12).folder_name == "shard-00003-of-00012"
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(ConfigError, match="shard"):
            ShardSpec.resolve(bad, {})


def test_job_file_refuses_another_split_or_another_job(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    out = tmp_path / "out"
    first = claim_shard(out, ShardSpec(0, 4), open_source(path), {"job": 1})
    assert first.range == JobFile.load(out).ranges[0] and JobFile.load(out).total_rows == N
    assert claim_shard(out, ShardSpec(3, 4), open_source(path), {"job": 1}).range.end == N
    with pytest.raises(ShardError, match=r"job of 4 shards.*shard 1/8.*--shard K/4"):
        claim_shard(out, ShardSpec(1, 8), open_source(path), {"job": 1})
    with pytest.raises(ShardError, match=r"different job \(differs in: job\)"):
        claim_shard(out, ShardSpec(1, 4), open_source(path), {"job": 2})


# ---- end to end on the tiny model --------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=1024)


def invoke(*args):
    return CliRunner().invoke(main, ["run", *map(str, args), "--no-progress"], catch_exceptions=False)


def test_shards_merge_to_the_single_run_and_mismatches_are_refused(tmp_path, model_dir, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:40])
    common = ("--model", model_dir, "--input", src, "--max-tokens", 6, "--temperature", 0.7, "--seed", 5,
              "--keep-columns", "id", "--part-rows", 4)
    r = invoke(*common, "--output", tmp_path / "single")
    assert r.exit_code == 0, r.output
    single = read_results(tmp_path / "single")

    out = tmp_path / "sharded"
    for k in (2, 0):
        r = invoke(*common, "--output", out, "--shard", f"{k}/3")
        assert r.exit_code == 0, r.output
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")  # the last shard takes K/N from its Slurm array task
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    r = invoke(*common, "--output", out)
    assert r.exit_code == 0 and "14 rows" in r.output, r.output
    job, states = shard_states(out)
    assert job.shards == 3 and [s.complete for s in states] == [True] * 3
    merged = pa.concat_tables([read_results(s.folder) for s in states])
    assert merged.column("row_index").to_pylist() == list(range(40))
    assert merged.to_pylist() == single.to_pylist()

    r = invoke(*common, "--output", out, "--shard", "1/4")
    assert r.exit_code == 1 and "job of 3 shards" in r.output
    r = invoke(*common, "--output", out, "--shard", "none")
    assert r.exit_code == 1 and "--shard K/3" in r.output
    r = invoke(*common[:-2], "--part-rows", 2, "--max-tokens", 7, "--output", out, "--shard", "1/3")
    assert r.exit_code == 1 and "different job" in r.output and "params" in r.output
    r = invoke(*common, "--output", tmp_path / "single", "--shard", "0/2")
    assert r.exit_code == 1 and "unsharded run" in r.output


def test_shard_states_report_missing_rows(tmp_path, model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:20])
    out = tmp_path / "out"
    r = invoke("--model", model_dir, "--input", src, "--max-tokens", 3, "--output", out, "--shard", "0/2")
    assert r.exit_code == 0, r.output
    job, states = shard_states(out)
    assert [(s.done, s.range.num_rows, s.started, s.complete) for s in states] == [(10, 10, True, True), (0, 10, False, False)]
    assert states[1].describe_missing() == "10-19"

    status = CliRunner().invoke(main, ["status", str(out)])
    assert status.exit_code == 0, status.output
    assert "stopped, 10/20 rows (50.0%), 0 errors; 2 shards: 1 finished, 1 not started" in status.output
    assert re.search(r"^\s+0\s+0-9\s+10/10\s+0\s+finished", status.output, re.M), status.output
    assert re.search(r"^\s+1\s+10-19\s+0/10\s+0\s+not started", status.output, re.M), status.output
    refused = CliRunner().invoke(main, ["export", str(out), "--to", str(tmp_path / "all.parquet")])
    assert refused.exit_code == 1 and "shard 1 (shard-00001-of-00002) lacks 10 of 10 rows: 10-19" in refused.output
    assert not (tmp_path / "all.parquet").exists()
    partial = CliRunner().invoke(main, ["export", str(out), "--to", str(tmp_path / "half.jsonl"), "--partial"])
    assert partial.exit_code == 0 and "10 rows" in partial.output and "10 rows missing: 10-19" in partial.output

    r = invoke("--model", model_dir, "--input", src, "--max-tokens", 3, "--output", out, "--shard", "1/2")
    assert r.exit_code == 0, r.output
    single = pa.concat_tables([read_results(s.folder) for s in shard_states(out)[1]])
    for name in ("all.parquet", "all.arrow", "all.jsonl"):
        done = CliRunner().invoke(main, ["export", str(out), "--to", str(tmp_path / name)])
        assert done.exit_code == 0 and "20 rows" in done.output, done.output
    assert pq.read_table(tmp_path / "all.parquet").to_pylist() == single.to_pylist()
    assert pa.ipc.open_file(tmp_path / "all.arrow").read_all().to_pylist() == single.to_pylist()
    lines = (tmp_path / "all.jsonl").read_text().splitlines()
    assert [json.loads(line)["row_index"] for line in lines] == list(range(20))
