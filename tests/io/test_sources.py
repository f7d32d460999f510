from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchjob.io.ranges import RowRanges
from batchjob.io.sources import (
    DatasetsSource,
    InputRow,
    JsonlSource,
    ParquetSource,
    SourceError,
    open_source,
    validate_columns,
)

N = 200
RECORDS = [{"id": f"r{i}", "prompt": f"prompt number {i}", "n": i} for i in range(N)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "data.jsonl", RECORDS)


@pytest.fixture
def parquet_dir(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    # Three files, 50-row row groups; written out of name order to check sorting.
    for name, lo, hi in [("b.parquet", 80, 150), ("a.parquet", 0, 80), ("c.parquet", 150, N)]:
        pq.write_table(pa.Table.from_pylist(RECORDS[lo:hi]), folder / name, row_group_size=50)
    return folder


@pytest.fixture
def datasets_dir(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({k: [r[k] for r in RECORDS] for k in RECORDS[0]})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    return tmp_path / "ds"


def collect(rows):
    return [(r.row_index, r.record) for r in rows]


def test_every_format_yields_the_same_rows(jsonl, parquet_dir, datasets_dir, tmp_path):
    single = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), single, row_group_size=64)
    expected = list(enumerate(RECORDS))
    for path, kind in [(jsonl, JsonlSource), (single, ParquetSource), (parquet_dir, ParquetSource),
                       (datasets_dir, DatasetsSource)]:
        source = open_source(path)
        assert isinstance(source, kind)
        assert source.columns == ["id", "prompt", "n"]
        assert collect(source.rows()) == expected, path
    assert open_source(jsonl).num_rows is None
    assert open_source(parquet_dir).num_rows == N
    assert open_source(datasets_dir).num_rows == N


def test_skip_leaves_rows_out_in_every_format(jsonl, parquet_dir, datasets_dir):
    skip = RowRanges([(0, 60), (100, 101), (150, 199)])
    expected = [(i, RECORDS[i]) for i in range(N) if i not in skip]
    for path in (jsonl, parquet_dir, datasets_dir):
        assert collect(open_source(path).rows(skip)) == expected, path


def test_columns_narrow_the_records(jsonl, parquet_dir, datasets_dir):
    for path in (jsonl, parquet_dir, datasets_dir):
        first = next(iter(open_source(path).rows(columns=["prompt"])))
        assert first == InputRow(0, {"prompt": "prompt number 0"}, None)


def test_parquet_skip_does_not_read_skipped_row_groups_or_files(parquet_dir, monkeypatch):
    reads = []
    original = ParquetSource._read_row_group

    def counting(self, pf, index, columns):
        reads.append((pf.metadata.num_rows, index))
        return original(self, pf, index, columns)

    monkeypatch.setattr(ParquetSource, "_read_row_group", counting)
    opened = []
    real_file = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda path, *a, **k: opened.append(path.name) or real_file(path, *a, **k))

    # a.parquet: rows 0-79 in groups [0,50) [50,80); b: 80-149 [80,130) [130,150); c: 150-199 one group.
    source = open_source(parquet_dir)
    rows = collect(source.rows(RowRanges([(0, 130), (160, 200)])))
    assert rows == [(i, RECORDS[i]) for i in range(130, 160)]
    assert opened == ["b.parquet", "c.parquet"]  # a.parquet entirely skipped: never opened
    assert reads == [(70, 1), (50, 0)]  # only b's 2nd group and c's group (partly needed) were read


def test_parquet_reads_bounded_batches(tmp_path, monkeypatch):
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"x": list(range(10_000))}), path, row_group_size=10_000)
    source = open_source(path)
    source.batch_rows = 256
    sizes = []
    original = ParquetSource._read_row_group

    def recording(self, pf, index, columns):
        for batch in original(self, pf, index, columns):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(ParquetSource, "_read_row_group", recording)
    assert sum(1 for _ in source.rows()) == 10_000
    assert max(sizes) <= 256


def test_datasets_skip_does_not_open_fully_skipped_shards(datasets_dir, monkeypatch):
    source = open_source(datasets_dir)
    opened = []
    original = DatasetsSource._open
    monkeypatch.setattr(DatasetsSource, "_open", lambda self, f: opened.append(f.name) or original(self, f))
    first_shard = source._file_rows[0]
    rows = collect(source.rows(RowRanges([(0, first_shard)])))
    assert rows[0][0] == first_shard and len(rows) == N - first_shard
    assert source.files[0].name not in opened


def test_datasets_dict_is_refused_with_its_splits_and_a_split_path_works(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"]})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"splits train, test.*dd/train"):
        open_source(tmp_path / "dd")
    assert collect(open_source(tmp_path / "dd" / "train").rows()) == [(0, {"prompt": "a"}), (1, {"prompt": "b"})]


def test_jsonl_bad_lines_become_row_errors_and_blank_lines_are_not_rows(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n'
                     b"\n"
                     b'{"prompt": "b",}\n'  # line 3: invalid JSON
                     b"   \r\n"
                     b"[1, 2]\n"  # line 5: not an object
                     b'{"prompt": "c"}\r\n'
                     b'{"prompt": "d"}')  # no trailing newline
    rows = list(open_source(path).rows())
    assert [r.row_index for r in rows] == [0, 1, 2, 3, 4]
    assert [r.record for r in rows] == [{"prompt": "a"}, None, None, {"prompt": "c"}, {"prompt": "d"}]
    assert rows[1].error.startswith("data.jsonl line 3: invalid JSON: ")
    assert rows[2].error == "data.jsonl line 5: expected a JSON object, got list"
    assert rows[0].error is None


def test_jsonl_resume_seeks_to_a_byte_offset(tmp_path):
    path = tmp_path / "data.jsonl"
    # Blank lines between rows must not shift row_index between a fresh run and a resume.
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 7 == 0 else "") for i, r in enumerate(RECORDS)))
    source = open_source(path)
    fresh, positions = [], {}
    for row in source.rows():
        fresh.append((row.row_index, row.record))
        positions[row.row_index] = source.position()
    assert positions[N - 1] == (N, path.stat().st_size)
    assert fresh == list(enumerate(RECORDS))

    start = positions[122]  # resume after row 122
    assert start[0] == 123
    resumed = open_source(path)
    rows = collect(resumed.rows(start_offset=start))
    assert rows == fresh[123:]
    assert resumed.position() == positions[N - 1]
    # skip still applies after the seek
    assert collect(open_source(path).rows(RowRanges([(123, 190)]), start_offset=start)) == fresh[190:]


def test_jsonl_refuses_an_offset_inside_a_line(jsonl):
    with pytest.raises(SourceError, match="not at a line start"):
        list(open_source(jsonl).rows(start_offset=(1, 5)))


def test_jsonl_errors_after_a_seek_cite_the_byte_offset(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\nnot json\n')
    rows = list(open_source(path).rows(start_offset=(1, 9)))
    assert [r.row_index for r in rows] == [1, 2]
    assert rows[1].error.startswith("data.jsonl byte 18: invalid JSON")


def test_jsonl_read_ahead_stays_bounded_on_a_large_file(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(200_000):
            f.write('{"prompt": "row %d"}\n' % i)
    source = open_source(path)
    source.chunk_bytes = 64 * 1024
    count = 0
    for row in source.rows():
        count += 1
    assert count == 200_000 and row.record == {"prompt": "row 199999"}
    longest_line = 30
    assert source.peak_buffer_bytes <= source.chunk_bytes + longest_line
    assert path.stat().st_size > 40 * source.chunk_bytes  # the file is far larger than what was held


def test_jsonl_long_line_larger_than_a_chunk(tmp_path):
    path = tmp_path / "long.jsonl"
    text = "word " * 50_000
    write_jsonl(path, [{"prompt": "short"}, {"prompt": text}, {"prompt": "after"}])
    source = open_source(path)
    source.chunk_bytes = 4096
    assert [r.record["prompt"] for r in source.rows()] == ["short", text, "after"]


def test_jsonl_columns_come_from_the_first_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": 1}, {"id": 2, "prompt": "x"}])
    assert open_source(path).columns == ["id", "prompt"]


def test_json_array_file_is_a_job_level_error(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS[:3], indent=2))
    with pytest.raises(SourceError, match="JSON array"):
        open_source(path)


def test_a_file_of_no_json_objects_does_not_look_like_json_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("hello\nworld\n")
    with pytest.raises(SourceError) as e:
        open_source(path)
    assert str(e.value).startswith(f"{path} does not look like JSON Lines: none of its first 2 lines is a JSON object;")


def test_missing_column_message_lists_available_columns(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"a": [1], "b": [2], "c": [3]}), path)
    source = open_source(path)
    validate_columns(source, ["a", "c"])
    with pytest.raises(SourceError) as e:
        validate_columns(source, ["x"])
    assert str(e.value) == f"column 'x' not found in {path}; available columns: a, b, c"


def test_missing_path_and_unknown_format(tmp_path):
    with pytest.raises(SourceError, match="input not found: .*nope.jsonl"):
        open_source(tmp_path / "nope.jsonl")
    (tmp_path / "data.xlsx").write_text("a,b\n")
    with pytest.raises(SourceError, match=r"JSON Lines.*CSV.*TSV.*Parquet.*datasets"):
        open_source(tmp_path / "data.xlsx")
    with pytest.raises(SourceError, match="unknown input_format 'xlsx'"):
        open_source(tmp_path / "data.xlsx", input_format="xlsx")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no \\*.parquet"):
        open_source(tmp_path / "empty")
    # an explicit format overrides the suffix
    (tmp_path / "rows.txt").write_text('{"a": 1}\n')
    assert collect(open_source(tmp_path / "rows.txt", input_format="jsonl").rows()) == [(0, {"a": 1})]


def test_corrupt_parquet_is_a_source_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(SourceError, match="cannot read .*bad.parquet as Parquet"):
        open_source(path)


def test_parquet_folder_with_mismatched_columns_is_refused(tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"b": [1]}), tmp_path / "2.parquet")
    with pytest.raises(SourceError, match="same columns"):
        open_source(tmp_path)


def test_sample_data_is_the_same_in_both_formats():
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "jobs" / "data"
    jsonl_rows = collect(open_source(data / "prompts.jsonl").rows())
    assert jsonl_rows == collect(open_source(data / "prompts.parquet").rows())
    assert jsonl_rows[0][1]["prompt"] == "What is the capital of France?"
    assert len(jsonl_rows) >= 250
    chats = [r.record["messages"] for r in open_source(data / "chat.jsonl").rows()]
    assert any(m[0]["role"] == "system" for m in chats) and any(len(m) > 2 for m in chats)


def test_a_fifo_is_read_whole_without_waiting_for_its_writer_to_open(tmp_path):
    """A FIFO opens before any writer does (a blocking open would hold the main thread where Ctrl-C may not reach it:
    io/sources/pipes.py), reads what the writer wrote in its chunks, and ends when the writer leaves."""
    import os
    import threading
    from pathlib import Path

    from batchjob.io.sources.pipes import PipeReader, open_input

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    reader = open_input(fifo)  # no writer yet: returns at once
    assert isinstance(reader, PipeReader)
    lines = [f'{{"prompt": "row {i}"}}\n'.encode() for i in range(500)]

    def write():
        with open(fifo, "wb") as w:
            for line in lines:
                w.write(line)
                w.flush()

    writer = threading.Thread(target=write)
    writer.start()
    got = bytearray()
    with reader:
        while chunk := reader.read(64):
            got += chunk
    writer.join()
    assert bytes(got) == b"".join(lines)
    with open_input(Path(__file__)) as plain:  # a regular file opens as Python opens it
        assert not isinstance(plain, PipeReader)
