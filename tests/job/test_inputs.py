"""Inputs people have: compressed JSONL, CSV/TSV, folders of JSONL, hive-partitioned Parquet, OpenAI-style
messages in any input, and an input fingerprint by content (a copy or a touch resumes, a changed byte does not)."""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjob.job.options import fingerprint as fingerprint_module
from batchjob.cli.main import main
from batchjob.job.options.config import ConfigError, JobConfig
from batchjob.job.options.fingerprint import input_identity
from batchjob.io.manifest import Manifest
from batchjob.io.ranges import RowRanges
from batchjob.io.parts import read_results
from batchjob.io.sources import (
    CompressedJsonlSource,
    CsvSource,
    JsonlSource,
    ParquetDatasetSource,
    ParquetSource,
    SourceError,
    open_source,
    validate_columns,
)
from batchjob.models.tokenizer import Tokenizer
from batchjob.job.rows.prompt_builder import PromptBuilder, RowError, row_sampling
from batchjob.sharding.shards import ShardError, ShardSource, ShardSpec, plan_shards

N = 60
RECORDS = [{"id": i, "prompt": f"prompt number {i}"} for i in range(N)]
FAST = ["--kv-cache-gb", "0.02", "--swap-space-gb", "0.01", "--no-progress"]


def jsonl_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def write_zstd(path, data: bytes):
    with pa.output_stream(str(path), compression="zstd") as f:
        f.write(data)
    return path


def collect(rows):
    return [(r.row_index, r.record, r.error) for r in rows]


def ok(records, first=0):
    return [(first + i, r, None) for i, r in enumerate(records)]


# ---- compressed JSONL ---------------------------------------------------------------------------------------


@pytest.fixture(params=["gz", "zst"])
def compressed(request, tmp_path):
    path = tmp_path / f"data.jsonl.{request.param}"
    data = jsonl_bytes(RECORDS)
    if request.param == "gz":
        path.write_bytes(gzip.compress(data))
    else:
        write_zstd(path, data)
    return path


def test_compressed_jsonl_streams_every_row_and_counts_them_at_the_end(compressed):
    source = open_source(compressed)
    assert isinstance(source, CompressedJsonlSource) and not isinstance(source, JsonlSource)  # no byte offsets
    assert source.format_name == ("JSONL (gzip)" if compressed.suffix == ".gz" else "JSONL (zstd)")
    assert source.columns == ["id", "prompt"]
    assert source.num_rows is None  # not known before a read reaches the end
    source.chunk_bytes = 256  # many chunks, lines split across them
    assert collect(source.rows()) == ok(RECORDS)
    assert source.num_rows == N


def test_compressed_jsonl_resumes_by_skipping_the_committed_rows(compressed):
    skip = RowRanges([(0, 25), (30, 31), (50, 60)])
    rows = collect(open_source(compressed).rows(skip))
    assert rows == [(i, RECORDS[i], None) for i in range(N) if i not in skip]
    source = open_source(compressed)
    assert collect(source.rows(RowRanges([(0, N)]))) == [] and source.num_rows == N  # still counted


def test_a_bad_line_in_a_compressed_file_is_a_row_error_naming_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n\n{"prompt": "b",}\n[1]\n{"prompt": "c"}'))
    rows = list(open_source(path).rows())
    assert [r.row_index for r in rows] == [0, 1, 2, 3]
    assert rows[1].error.startswith("data.jsonl.gz line 3: invalid JSON")
    assert rows[2].error == "data.jsonl.gz line 4: expected a JSON object, got list"
    assert rows[3].record == {"prompt": "c"}


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_a_truncated_compressed_file_is_a_job_level_error_naming_it(tmp_path, codec):
    data = jsonl_bytes({"prompt": f"row {i}", "n": i * 7919 % 10007} for i in range(100_000))
    path = tmp_path / ("data.jsonl.gz" if codec == "gzip" else "data.jsonl.zst")
    whole = gzip.compress(data, compresslevel=1) if codec == "gzip" else write_zstd(path, data).read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    source = open_source(path)  # its first lines are whole
    with pytest.raises(SourceError, match=rf"cannot read .*{path.name} after line \d+: .* truncated {codec}\)"):
        list(source.rows())
    path.write_bytes(b"not compressed at all\n")
    with pytest.raises(SourceError, match=rf"cannot read .*{path.name}"):
        open_source(path)


def test_an_explicit_format_names_the_codec_and_openai_batch_must_be_plain(tmp_path):
    path = tmp_path / "rows.bin"
    path.write_bytes(gzip.compress(jsonl_bytes(RECORDS[:3])))
    assert collect(open_source(path, input_format="jsonl.gz").rows()) == ok(RECORDS[:3])
    zst = write_zstd(tmp_path / "rows.z", jsonl_bytes(RECORDS[:2]))
    assert collect(open_source(zst, input_format="jsonl.zst").rows()) == ok(RECORDS[:2])
    shutil.copyfile(path, tmp_path / "requests.jsonl.gz")
    with pytest.raises(SourceError, match="OpenAI Batch input must be one uncompressed .jsonl file"):
        open_source(tmp_path / "requests.jsonl.gz", input_format="openai-batch")


def test_compressed_and_streamed_inputs_cannot_be_sharded_and_the_error_says_so(compressed, tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\na\nb\n")
    for path in (compressed, csv):
        with pytest.raises(ShardError, match="row count is not known before a full read, so it cannot be cut into shards"):
            plan_shards(open_source(path), 2)


# ---- CSV / TSV ------------------------------------------------------------------------------------------------


def test_csv_reads_quoted_values_as_text_and_bad_records_as_row_errors_in_place(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b'id,prompt,max_tokens\n'
                     b'1,"Hello, world",8\n'
                     b'2,"two\nlines and ""quotes""",\n'  # a newline and quotes inside a value; an empty field
                     b'3,too,many,fields\n'  # record 4
                     b'4,N/A,2\n'  # text, not pyarrow's null
                     b'5\n')  # record 6, the last
    source = open_source(path)
    assert isinstance(source, CsvSource) and source.format_name == "CSV"
    assert source.columns == ["id", "prompt", "max_tokens"] and source.num_rows is None
    rows = collect(source.rows())
    assert rows == [
        (0, {"id": "1", "prompt": "Hello, world", "max_tokens": "8"}, None),
        (1, {"id": "2", "prompt": 'two\nlines and "quotes"', "max_tokens": None}, None),
        (2, None, "data.csv record 4: expected 3 fields, got 4: '3,too,many,fields'"),
        (3, {"id": "4", "prompt": "N/A", "max_tokens": "2"}, None),
        (4, None, "data.csv record 6: expected 3 fields, got 1: '5'"),
    ]
    assert source.num_rows == 5


def test_csv_skip_row_order_across_blocks_and_bad_records(tmp_path):
    path = tmp_path / "big.csv"
    lines, expected = ["prompt,n"], []
    for i in range(3000):
        if i % 97 == 5:
            lines.append(f"bad,{i},extra")
            expected.append((i, None))
        else:
            lines.append(f'"row\n{i}",{i}')
            expected.append((i, {"prompt": f"row\n{i}", "n": str(i)}))
    path.write_text("\n".join(lines) + "\n")
    source = open_source(path)
    source.block_bytes, source.batch_rows = 4096, 100  # many blocks; bad records land in several
    rows = [(r.row_index, r.record) for r in source.rows()]
    assert rows == expected
    skip = RowRanges([(0, 1500), (2000, 2001)])
    assert [(r.row_index, r.record) for r in source.rows(skip)] == [e for e in expected if e[0] not in skip]
    assert source.num_rows == 3000


def test_tsv_and_a_non_utf8_record(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_bytes(b"prompt\tid\nsay \"hi\", then go\t1\nbad \xff byte\t2\nlast\t3\n")
    source = open_source(path)
    assert source.format_name == "TSV"
    rows = collect(source.rows())
    assert rows[0] == (0, {"prompt": 'say "hi", then go', "id": "1"}, None)
    assert rows[1][1] is None and rows[1][2].startswith("data.tsv record 3: not UTF-8 text")
    assert rows[2] == (2, {"prompt": "last", "id": "3"}, None)


def test_csv_job_level_problems(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(SourceError, match="empty.csv is empty; a CSV input needs a header row"):
        open_source(tmp_path / "empty.csv")
    (tmp_path / "twice.csv").write_text("prompt,prompt\na,b\n")
    with pytest.raises(SourceError, match="names 'prompt' more than once"):
        open_source(tmp_path / "twice.csv")
    (tmp_path / "cols.csv").write_text("text\nhello\n")
    with pytest.raises(SourceError, match="column 'prompt' not found .*available columns: text$"):
        validate_columns(open_source(tmp_path / "cols.csv"), ["prompt"])


def test_a_missing_prompt_column_says_which_flag_names_another(tmp_path):
    from batchjob.job.inputs import open_inputs

    path = tmp_path / "cols.csv"
    path.write_text("question\nhello\n")
    with pytest.raises(SourceError) as e:
        open_inputs(JobConfig(input=str(path), output=str(tmp_path / "out")), [(str(path), None, None)])
    assert str(e.value) == (f"column 'prompt' not found in {path}; available columns: question; pass --prompt-column "
                            "NAME (or --messages-column NAME for chat messages) to read the prompt from another column")


# ---- folders ------------------------------------------------------------------------------------------------


def test_jsonl_folder_reads_its_files_in_name_order_and_names_the_skipped_ones(tmp_path, caplog):
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "b.jsonl").write_bytes(jsonl_bytes(RECORDS[20:45]))
    (folder / "a.jsonl").write_bytes(jsonl_bytes(RECORDS[:20]))
    (folder / "c.ndjson").write_bytes(jsonl_bytes(RECORDS[45:]).rstrip(b"\n"))  # no final newline
    (folder / "README.md").write_text("not data")
    (folder / "meta.json").write_text("{}")
    (folder / "old").mkdir()
    (folder / "_SUCCESS").write_text("")  # hidden names (., _) are not data and not worth a warning
    (folder / ".a.jsonl.crc").write_text("")
    with caplog.at_level(logging.WARNING, logger="batchjob.io.sources"):
        source = open_source(folder)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0] == f"{folder}: 3 entries skipped, not JSON Lines: README.md, meta.json, old/"
    assert isinstance(source, JsonlSource) and source.columns == ["id", "prompt"]
    assert [f.name for f in source.files] == ["a.jsonl", "b.jsonl", "c.ndjson"]
    assert collect(source.rows()) == ok(RECORDS)


def test_jsonl_folder_resumes_and_shards_by_byte_offset_across_its_files(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    for name, lo, hi in [("0.jsonl", 0, 10), ("1.jsonl", 10, 10), ("2.jsonl", 10, 33), ("3.jsonl", 33, N)]:
        (folder / name).write_bytes(jsonl_bytes(RECORDS[lo:hi]))  # 1.jsonl is empty
    (folder / "2.jsonl").write_bytes(b"\n" + jsonl_bytes(RECORDS[10:33]))  # a blank line first
    source = open_source(folder)
    positions = {}
    for row in source.rows():
        positions[row.row_index] = source.position()
    for after in (9, 10, 32, 40):  # the end of a file, a blank line, the last row of one and inside another
        resumed = open_source(folder)
        assert collect(resumed.rows(start_offset=positions[after])) == ok(RECORDS[after + 1:], after + 1)
    ends = list(open_source(folder).row_ends())
    assert len(ends) == N and ends[-1] == sum(f.stat().st_size for f in source.files)
    with pytest.raises(SourceError, match="not at a line start"):
        list(open_source(folder).rows(start_offset=(12, positions[11][1] + 3)))

    ranges = plan_shards(source, 3)
    shard_rows = []
    for k, rng in enumerate(ranges):
        shard_rows += [r.row_index for r in ShardSource(open_source(folder), ShardSpec(k, 3), rng).rows()]
    assert shard_rows == list(range(N))


def test_jsonl_folder_with_compressed_files_resumes_by_skipping(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(RECORDS[:30])))
    write_zstd(folder / "b.jsonl.zst", jsonl_bytes(RECORDS[30:50]))
    (folder / "c.jsonl").write_bytes(jsonl_bytes(RECORDS[50:]))
    source = open_source(folder)
    assert isinstance(source, CompressedJsonlSource) and source.format_name == "JSONL (compressed)"
    skip = RowRanges([(0, 35)])
    assert collect(source.rows(skip)) == ok(RECORDS[35:], 35)
    assert source.num_rows == N


def test_hive_partitioned_parquet_exposes_the_partition_columns(tmp_path, caplog):
    root = tmp_path / "hive"
    expected = []
    for year in (2023, 2024):
        for lang in ("de", "en"):
            folder = root / f"year={year}" / f"lang={lang}"
            folder.mkdir(parents=True)
            rows = [{"prompt": f"{year} {lang} {i}"} for i in range(5)]
            pq.write_table(pa.Table.from_pylist(rows), folder / "part-0.parquet", row_group_size=2)
            expected += [{**r, "year": year, "lang": lang} for r in rows]
    (root / "year=2024" / "notes.txt").write_text("x")
    (root / "year=2023" / "_SUCCESS").write_text("")
    with caplog.at_level(logging.WARNING, logger="batchjob.io.sources"):
        source = open_source(root)
    assert [r.getMessage() for r in caplog.records] == [f"{root}: 1 entry skipped, not Parquet: year=2024/notes.txt"]
    assert isinstance(source, ParquetDatasetSource)
    assert source.columns == ["prompt", "year", "lang"] and source.num_rows == 20
    assert collect(source.rows()) == ok(expected)
    assert source.unit_starts() == [0, 2, 4, 5, 7, 9, 10, 12, 14, 15, 17, 19]  # row groups of 2, 2, 1 per file
    skip = RowRanges([(0, 12), (13, 14)])
    assert collect(source.rows(skip)) == [(i, expected[i], None) for i in range(N) if i < 20 and i not in skip]
    assert next(iter(source.rows(columns=["lang"]))).record == {"lang": "de"}

    ranges = plan_shards(source, 2)  # row counts known: shards cut at row groups
    assert [(r.start, r.end) for r in ranges] == [(0, 10), (10, 20)]
    assert [r.record for r in ShardSource(source, ShardSpec(1, 2), ranges[1]).rows()] == expected[10:]


def test_a_flat_parquet_folder_names_its_stray_files(tmp_path, caplog):
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "a.parquet")
    (tmp_path / "a.csv").write_text("id\n1\n")
    with caplog.at_level(logging.WARNING, logger="batchjob.io.sources"):
        source = open_source(tmp_path)
    assert isinstance(source, ParquetSource) and source.num_rows == N
    assert [r.getMessage() for r in caplog.records] == [f"{tmp_path}: 1 entry skipped, not Parquet: a.csv"]


def test_formats_are_detected_by_name_and_folders_by_contents(tmp_path):
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(b'{"a": 1}\n'))
    (tmp_path / "x.ndjson.zst").write_bytes(b"")
    write_zstd(tmp_path / "x.ndjson.zst", b'{"a": 1}\n')
    (tmp_path / "x.csv").write_text("a\n1\n")
    (tmp_path / "x.tsv").write_text("a\n1\n")
    kinds = {name: type(open_source(tmp_path / name)).__name__ for name in ("x.jsonl.gz", "x.ndjson.zst", "x.csv", "x.tsv")}
    assert kinds == {"x.jsonl.gz": "CompressedJsonlSource", "x.ndjson.zst": "CompressedJsonlSource",
                     "x.csv": "CsvSource", "x.tsv": "CsvSource"}
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(SourceError, match="no \\*.parquet or \\*.jsonl files, no key=value subfolders"):
        open_source(tmp_path / "empty")


# ---- messages and text values -------------------------------------------------------------------------------

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return Tokenizer.from_hf_dir(tiny_tokenizer_dir)


def test_content_parts_and_the_developer_role_render_through_the_chat_template(tokenizer):
    builder = PromptBuilder(JobConfig(input="x", system_prompt="Be brief."), tokenizer, use_messages=True, chat_template=TEMPLATE)
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    # developer is the system message, so --system-prompt is not added; parts are joined with newlines
    assert tokenizer.decode(builder.token_ids({"messages": msgs})) == "[system] Answer in French.\n[user] Hi\nthere\n[assistant] "
    assert builder.messages({"messages": json.dumps(msgs)}) == builder.messages({"messages": msgs})  # a CSV's text
    # Parquet gives parts as structs, with a null for each field a part does not have
    table = pa.table({"messages": [[{"role": "user", "content": [{"type": "text", "text": "Hi", "image_url": None}]}]]})
    assert builder.messages(table.to_pylist()[0]) == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]
    model_template = PromptBuilder(JobConfig(input="x"), tokenizer, use_messages=True)
    ids = model_template.token_ids({"messages": msgs})
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nAnswer in French.<|im_end|>")


def test_parts_that_are_not_text_fail_the_row(tokenizer):
    builder = PromptBuilder(JobConfig(input="x"), tokenizer, use_messages=True, chat_template=TEMPLATE)
    image = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RowError, match=r"message 0: content part 1 is an image \(image_url\): this model is a text-only model; images need"):
        builder.token_ids({"messages": image})
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]
    with pytest.raises(RowError, match="message 0: content part 0 has type 'input_audio'; only text and image parts are supported"):
        builder.token_ids({"messages": audio})
    with pytest.raises(RowError, match="invalid JSON"):
        builder.token_ids({"messages": "[{not json"})
    with pytest.raises(RowError, match="message 0 needs string 'role' and 'content'"):
        builder.token_ids({"messages": [{"role": "user", "content": 5}]})


def test_sampling_parameters_given_as_text_are_read_as_json():
    base = JobConfig(input="x").sampling_defaults()
    params = row_sampling({"max_tokens": "8", "temperature": "0.5", "stop": "###", "stop_token_ids": "[3, 4]",
                           "ignore_eos": "true"}, base)
    assert (params.max_tokens, params.temperature, params.stop, params.stop_token_ids, params.ignore_eos) \
        == (8, 0.5, ("###",), (3, 4), True)  # `stop` text is a stop string, not JSON
    with pytest.raises(RowError, match="max_tokens: expected an integer, got 'many'"):
        row_sampling({"max_tokens": "many"}, base)


# ---- the input fingerprint ------------------------------------------------------------------------------------


def test_identity_is_by_content_a_copy_or_touch_keeps_it_a_changed_byte_does_not(tmp_path):
    src = tmp_path / "a" / "data.jsonl"
    src.parent.mkdir()
    src.write_bytes(jsonl_bytes(RECORDS))
    before = input_identity(src, open_source(src))
    assert before["files"][0][:2] == ["data.jsonl", src.stat().st_size]
    copy = tmp_path / "b" / "data.jsonl"
    copy.parent.mkdir()
    shutil.copyfile(src, copy)  # same bytes, a new mtime, another folder
    os.utime(copy, (1e9, 1e9))
    assert input_identity(copy, open_source(copy)) == before
    os.utime(src, None)  # touch
    assert input_identity(src, open_source(src)) == before
    data = bytearray(src.read_bytes())
    data[100] = ord("X") if data[100] != ord("X") else ord("Y")
    src.write_bytes(bytes(data))  # one byte, same size
    after = input_identity(src, open_source(src))
    assert after != before and after["files"][0][1] == before["files"][0][1]


def test_a_folder_identity_lists_the_files_read_by_their_names_under_it(tmp_path):
    root = tmp_path / "hive"
    (root / "k=1").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a"]}), root / "k=1" / "p.parquet")
    (root / "k=1" / "notes.txt").write_text("not read, not in the identity")
    identity = input_identity(root, open_source(root))
    assert identity["format"] == "Parquet dataset" and identity["columns"] == ["prompt", "k"]
    assert [f[0] for f in identity["files"]] == ["k=1/p.parquet"]
    (root / "k=1" / "notes.txt").write_text("changed")
    assert input_identity(root, open_source(root)) == identity


def test_a_huge_file_is_hashed_by_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint_module, "CONTENT_HASH_WHOLE_BYTES", 1000)
    monkeypatch.setattr(fingerprint_module, "CONTENT_SAMPLES", 4)
    monkeypatch.setattr(fingerprint_module, "CONTENT_SAMPLE_BYTES", 100)
    path = tmp_path / "big.jsonl"
    data = bytearray(jsonl_bytes([{"prompt": "x" * 90}] * 100))  # 10,500 bytes; windows at 0, 3466, 6933, 10400
    path.write_bytes(bytes(data))
    source = open_source(path)
    first = input_identity(path, source)
    assert first["files"][0][2].startswith("sha256-sampled-4x100:")

    def changed_at(offset: int) -> dict:
        copy = bytearray(data)
        copy[offset] = ord("y")
        path.write_bytes(bytes(copy))
        return input_identity(path, source)

    assert changed_at(50) != first  # inside the first window
    assert changed_at(10_499) != first  # the last byte is in the last window
    assert changed_at(2000) == first  # between windows: not read, the price of sampling
    path.write_bytes(bytes(data) + b"\n")
    assert input_identity(path, source) != first  # a changed size always shows
    monkeypatch.setattr(fingerprint_module, "CONTENT_HASH_WHOLE_BYTES", 1 << 20)
    path.write_bytes(bytes(data))
    assert input_identity(path, source)["files"][0][2].startswith("sha256:")


# ---- whole jobs -------------------------------------------------------------------------------------------------


def test_jobs_on_the_new_inputs_run_and_resume(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=1024)
    rows = [{"prompt": f"Row {i}", "id": i} for i in range(6)]
    inputs = {"gz": tmp_path / "in.jsonl.gz", "csv": tmp_path / "in.csv"}
    inputs["gz"].write_bytes(gzip.compress(jsonl_bytes(rows)))
    inputs["csv"].write_text("prompt,id\n" + "".join(f"Row {i},{i}\n" for i in range(6)))
    texts = {}
    for kind, path in inputs.items():
        out = tmp_path / f"out-{kind}"
        args = ["run", "--model", str(model), "--input", str(path), "--output", str(out), "--max-tokens", "3",
                "--keep-columns", "id", *FAST]
        r = CliRunner().invoke(main, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert "6 rows (0 errors)" in r.output
        table = read_results(out)
        assert sorted(table.column("row_index").to_pylist()) == list(range(6))
        texts[kind] = dict(zip(table.column("row_index").to_pylist(), table.column("generated_text").to_pylist()))
        parts = [p.name for p in Manifest.load(out).parts]
        shutil.copyfile(path, tmp_path / "copy")  # a copied input (new mtime) is the same job:
        os.replace(tmp_path / "copy", path)
        r = CliRunner().invoke(main, args, catch_exceptions=False)
        assert r.exit_code == 0, r.output
        assert [p.name for p in Manifest.load(out).parts] == parts  # every row was committed: nothing ran again
    assert texts["gz"] == texts["csv"]  # the same prompts, the same text


def test_a_finished_job_on_a_streamed_input_can_be_exported(tmp_path, tiny_model_dir):
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(RECORDS[:4])))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", "--model", str(tiny_model_dir("llama", max_positions=1024)), "--input", str(path),
                                  "--output", str(out), "--max-tokens", "2", *FAST], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", str(out), "--to", str(tmp_path / "all.parquet")])
    assert r.exit_code == 0, r.output


def test_an_input_with_tools_and_no_tool_parser_is_read_with_auto(tmp_path):
    """A `tools` column, or an OpenAI Batch file whose chat bodies carry tools, makes a job that names no tool parser
    read their calls with auto (job/inputs.py); a job that names one, or whose input has none, keeps its own."""
    from batchjob.job.options.config import load_job
    from batchjob.job.inputs import input_folders, open_inputs, with_tool_parser

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", **chat}}
    inputs = {"column.jsonl": [{**chat, "tools": [tool]}, chat], "plain.jsonl": [chat],
              "batch.jsonl": [{"custom_id": "a", **line}, {"custom_id": "b", **line, "body": {**line["body"], "tools": [tool]}}],
              "batch_without.jsonl": [{"custom_id": "a", **line}]}
    for name, rows in inputs.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, given, want in (("column.jsonl", None, "auto"), ("batch.jsonl", None, "auto"), ("plain.jsonl", None, None),
                              ("batch_without.jsonl", None, None), ("column.jsonl", "hermes", "hermes")):
        cfg = load_job(None, {"input": str(tmp_path / name), "output": str(tmp_path / "out"), "tool_parser": given})
        sources, _, _ = open_inputs(cfg, input_folders(cfg, tmp_path / "out"))
        assert with_tool_parser(cfg, sources).tool_parser == want, name


def test_template_kwargs_for_a_job_of_plain_prompts_stop_it_at_start(tmp_path):
    """No chat template renders a plain prompt: the job's chat_template_kwargs would be ignored (vLLM's generate()
    takes none); with --chat, a messages column or an image column they reach the template."""
    from batchjob.job.options.config import load_job
    from batchjob.job.inputs import input_folders, open_inputs

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    values = {"input": str(src), "output": str(tmp_path / "out"), "chat_template_kwargs": {"enable_thinking": False}}
    cfg = load_job(None, values)
    with pytest.raises(ConfigError, match="chat_template_kwargs: the rows are plain prompts .* pass --chat"):
        open_inputs(cfg, input_folders(cfg, tmp_path / "out"))
    cfg = load_job(None, {**values, "chat": True})
    open_inputs(cfg, input_folders(cfg, tmp_path / "out"))
