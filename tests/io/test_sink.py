from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import pyarrow as pa
import pytest

from batchjob.io.manifest import Manifest, ManifestError
from batchjob.io.ranges import RowRanges
from batchjob.io.parts import RESULT_SCHEMA, read_results
from batchjob.io.recovery import FingerprintMismatch, SinkError, clear_results, fingerprint_changes
from batchjob.io.part_writer import OutputError
from batchjob.io.sink import ArrowSink

FP = {"model": "tiny", "temperature": 0.0, "input": "data.jsonl"}


def result(i, **kept):
    return {"row_index": i, "generated_text": f"answer {i}", "finish_reason": "stop",
            "prompt_tokens": 3, "completion_tokens": i % 5, "error": None, **kept}


def files(out):
    return sorted(p.name for p in out.iterdir())


def test_parts_and_manifest_round_trip(tmp_path):
    out = tmp_path / "out"
    order = [7, 3, 0, 24, 1, 2, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    with ArrowSink(out, fingerprint=FP, keep_columns=["id"], part_rows=10, total_rows=25) as sink:
        for i in order:
            sink.write(result(i, id=f"r{i}"))
    assert files(out) == ["commits.log", "manifest.json", "manifest.json.prev", "part-00000.arrow", "part-00001.arrow",
                          "part-00002.arrow"]

    manifest = Manifest.load(out)
    assert manifest.fingerprint == FP and manifest.total_rows == 25
    assert [p.num_rows for p in manifest.parts] == [10, 10, 5]
    assert manifest.parts[0].rows == [[0, 9], [24, 25]]
    assert manifest.done_rows().ranges() == [(0, 25)]
    for part in manifest.parts:
        data = (out / part.name).read_bytes()
        assert data[:6] == b"ARROW1"  # IPC file format, not a stream
        assert part.bytes == len(data) and part.sha256 == hashlib.sha256(data).hexdigest()

    first = pa.ipc.open_file(out / "part-00000.arrow").read_all()
    assert first.schema.names == [*RESULT_SCHEMA.names, "id"]
    assert first.column("row_index").to_pylist() == order[:10]  # written order within a part

    table = read_results(out)
    assert table.column("row_index").to_pylist() == list(range(25))
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(25)]
    assert table.schema.field("prompt_tokens").type == pa.int32()


def test_parts_are_readable_by_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    with ArrowSink(tmp_path, fingerprint=FP) as sink:
        sink.write(result(0))
    frame = pd.read_feather(tmp_path / "part-00000.arrow")
    assert frame["generated_text"].tolist() == ["answer 0"]


def test_done_holds_committed_rows_only(tmp_path):
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=10)
    for i in range(5):
        sink.write(result(i))
    assert sink.done.count() == 0
    assert Manifest.load(tmp_path).parts == []  # a fresh folder gets its manifest at once
    sink.commit()
    assert sink.done.ranges() == [(0, 5)]
    sink.close()
    assert ArrowSink(tmp_path, fingerprint=FP).done.ranges() == [(0, 5)]


def test_commits_after_part_seconds(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("batchjob.io.sink.time.monotonic", lambda: clock[0])
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=1000, part_seconds=30)
    sink.write(result(0))
    clock[0] += 29
    sink.write(result(1))
    assert sink.done.count() == 0
    clock[0] += 1
    sink.commit_if_due()  # also callable while no rows arrive
    sink.sync()  # the part is written on the writer thread
    assert sink.done.ranges() == [(0, 2)]
    sink.write(result(2))
    clock[0] += 31
    sink.write(result(3))  # the write itself notices
    sink.sync()
    assert sink.done.ranges() == [(0, 4)]


def test_resume_removes_uncommitted_parts_and_temp_files(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=4) as sink:
        for i in range(8):
            sink.write(result(i))
    # What a crash can leave: a part renamed but never listed, half-written temp files.
    shutil.copy(tmp_path / "part-00001.arrow", tmp_path / "part-00002.arrow")
    (tmp_path / ".part-00003.arrow.tmp").write_bytes(b"partial")
    (tmp_path / ".manifest.json.tmp").write_bytes(b"{")
    (tmp_path / "notes.txt").write_text("not ours")

    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=4)
    assert files(tmp_path) == ["commits.log", "manifest.json", "manifest.json.prev", "notes.txt", "part-00000.arrow",
                               "part-00001.arrow"]
    assert sink.done.ranges() == [(0, 8)]
    for i in range(8, 12):
        sink.write(result(i))
    sink.close()
    assert "part-00002.arrow" in files(tmp_path)
    assert read_results(tmp_path).column("row_index").to_pylist() == list(range(12))


def test_crash_between_part_rename_and_its_commit_record(tmp_path, monkeypatch):
    from batchjob.io.commit_log import CommitLog

    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    sink.write(result(0))
    sink.write(result(1))
    sink.sync()  # committed

    def crash(self, record):
        raise OSError("disk full")

    monkeypatch.setattr(CommitLog, "append", crash)
    sink.write(result(2))
    sink.write(result(3))  # hands the part to the writer thread, which fails
    with pytest.raises(OSError):
        sink.sync()  # the failure comes back at the next call
    with pytest.raises(OSError):
        sink.write(result(4))  # and stays: nothing more is committed
    monkeypatch.undo()
    assert "part-00001.arrow" in files(tmp_path)  # on disk, but not listed
    assert [p.name for p in sink.manifest.parts] == ["part-00000.arrow"] and sink.done.ranges() == [(0, 2)]

    resumed = ArrowSink(tmp_path, fingerprint=FP)
    assert resumed.done.ranges() == [(0, 2)]
    assert "part-00001.arrow" not in files(tmp_path)


def test_a_torn_last_commit_record_is_ignored_and_cut_off(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(6):
            sink.write(result(i))
    log = tmp_path / "commits.log"
    data = log.read_bytes()
    log.write_bytes(data[:-15])  # the last append cut short by a crash: its part is an orphan
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 4)]
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    assert sink.done.ranges() == [(0, 4)] and "part-00002.arrow" not in files(tmp_path)
    sink.write(result(4))
    sink.write(result(5))
    sink.close()
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 6)]  # appended after the cut: readable


def test_a_damaged_record_before_good_ones_is_damage_not_a_crash(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(6):
            sink.write(result(i))
    log = tmp_path / "commits.log"
    lines = log.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b'"num_rows":2', b'"num_rows":3')
    log.write_bytes(b"\n".join(lines))
    with pytest.raises(ManifestError, match="record 2 is damaged and valid records follow"):
        Manifest.load(tmp_path)


def test_records_rewritten_by_a_tool_still_verify_and_a_gap_after_the_snapshot_is_reported(tmp_path):
    """Records are verified against their bytes as written; one re-encoded (other key order and spacing,
    same content) falls back to the canonical check. Records missing between the snapshot and the log
    are an error naming the commits, never silently skipped."""
    from batchjob.io.commit_log import LOG, LOG_PREV

    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(6):
            sink.write(result(i))
    log = tmp_path / LOG
    lines = log.read_bytes().rstrip(b"\n").split(b"\n")
    lines[0] = json.dumps(json.loads(lines[0]), indent=1).replace("\n", "").encode()  # same record, re-encoded
    log.write_bytes(b"\n".join(lines) + b"\n")
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 6)]
    log.write_bytes(b"\n".join(lines[1:]) + b"\n")  # commit 1 lost, and no commits.log.prev holds it
    assert not (tmp_path / LOG_PREV).exists()
    with pytest.raises(ManifestError, match="commits 1-1 are missing after manifest.json"):
        Manifest.load(tmp_path)


def test_a_resume_reads_the_snapshot_and_the_current_log_only(tmp_path, monkeypatch):
    """commits.log.prev (what the last compaction absorbed) is read only to rebuild from manifest.json.prev."""
    from batchjob.io import commit_log, manifest as manifest_module

    with ArrowSink(tmp_path, fingerprint=FP, part_rows=1) as sink:
        for i in range(3):
            sink.write(result(i))
    Manifest.load(tmp_path).commit(tmp_path)  # compaction: the log becomes commits.log.prev
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=1) as sink:
        sink.write(result(3))
    read = []
    real = commit_log.read
    monkeypatch.setattr(manifest_module, "read", lambda path: read.append(path.name) or real(path))
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 4)] and read == ["commits.log"]
    read.clear()
    assert Manifest.load(tmp_path, "manifest.json.prev").num_rows() == 4 and read == ["commits.log", "commits.log.prev"]


def test_commit_bytes_grow_linearly_with_the_number_of_parts(tmp_path, monkeypatch):
    """10,000 commits of one-row parts: the log and its snapshots together write O(parts) bytes (the
    rewritten manifest of batchjob 0.1 wrote O(parts^2): ~12 GB for a 10M-row job in 1,000-row parts)."""
    from batchjob.io import commit_log, manifest as manifest_module

    written = [0]
    real_append, real_write = commit_log.CommitLog.append, manifest_module.atomic_write

    def append(self, record):
        before = self.bytes
        real_append(self, record)
        written[0] += self.bytes - before

    def atomic_write(path, data):
        written[0] += len(data)
        real_write(path, data)

    monkeypatch.setattr(commit_log.CommitLog, "append", append)
    monkeypatch.setattr(manifest_module, "atomic_write", atomic_write)
    monkeypatch.setattr("batchjob.io.part_writer.PartWriter.write", _tiny_part)
    per_part = []
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=1)
    for i in range(10_000):
        sink.write(result(i))
        if i + 1 in (1_000, 10_000):
            per_part.append(written[0] / (i + 1))
    sink.close()
    assert per_part[1] < 2.5 * per_part[0]  # bytes per commit stay flat (quadratic: 10x)
    assert per_part[1] < 2_000  # a record and its share of the snapshots, not the whole manifest
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 10_000)]
    assert len(Manifest.load(tmp_path).parts) == 10_000


def _tiny_part(self, columns, rows):
    from batchjob.io.manifest import PartEntry, utc_now

    name = f"part-{self.next_number:05d}.arrow"
    (self.out_dir / name).write_bytes(b"x")  # the part's content does not matter here, its entry does
    self.next_number += 1
    return PartEntry(name=name, num_rows=len(columns["row_index"]), rows=rows.to_json(), bytes=1,
                     sha256=hashlib.sha256(b"x").hexdigest(), created=utc_now())


@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_of_the_previous_format_is_read_and_converted(tmp_path, version):
    from dataclasses import asdict

    from batchjob.io.manifest import VERSION, _checksum

    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(4):
            sink.write(result(i))
    state = Manifest.load(tmp_path)
    # versions 1 and 2: one object per part, checksummed over the canonical encoding; 1 (batchjob 0.1): the
    # whole state in manifest.json, no log; 2: a snapshot at `seq` with the log beside it
    body = {"version": version, "fingerprint": state.fingerprint, "total_rows": state.total_rows,
            "parts": [asdict(p) for p in state.parts], "extra": state.extra} | ({"seq": state.seq} if version == 2 else {})
    (tmp_path / "manifest.json").write_text(json.dumps({**body, "checksum": _checksum(body)}))
    for name in ("commits.log", "manifest.json.prev"):
        (tmp_path / name).unlink()
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    assert sink.done.ranges() == [(0, 4)]
    assert json.loads((tmp_path / "manifest.json").read_text())["version"] == VERSION == 3  # written anew at once
    sink.write(result(4))
    sink.close()
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 5)]


def test_listed_part_that_is_missing_or_truncated_is_dropped(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(6):
            sink.write(result(i))
    (tmp_path / "part-00000.arrow").unlink()
    data = (tmp_path / "part-00002.arrow").read_bytes()
    (tmp_path / "part-00002.arrow").write_bytes(data[:-10])

    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    assert sink.repaired == ["part-00000.arrow", "part-00002.arrow"]
    assert sink.done.ranges() == [(2, 4)]
    assert "part-00002.arrow.corrupt" in files(tmp_path)
    assert Manifest.load(tmp_path).done_rows().ranges() == [(2, 4)]  # repair is committed at once
    for i in (0, 1, 4, 5):
        sink.write(result(i))
    sink.close()
    assert read_results(tmp_path).column("row_index").to_pylist() == list(range(6))
    assert not {"part-00000.arrow", "part-00002.arrow"} & {p.name for p in Manifest.load(tmp_path).parts}


def test_corrupt_manifest_is_detected(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP) as sink:
        sink.write(result(0))
    Manifest.load(tmp_path).commit(tmp_path)  # a snapshot that lists the part
    path = tmp_path / "manifest.json"
    data = json.loads(path.read_text())
    data["parts"]["num_rows"][0] = 2  # parts are stored as columns
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="corrupt \\(checksum mismatch\\)"):
        Manifest.load(tmp_path)
    path.write_text('{"version": 1, "parts": [')  # torn write
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_results(tmp_path)


@pytest.mark.parametrize("damage", ["edited", "truncated", "deleted"])
def test_a_damaged_manifest_is_rebuilt_from_the_previous_generation_and_verified_parts(tmp_path, damage):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=3, total_rows=9) as sink:
        for i in range(9):
            sink.write(result(i))
    path = tmp_path / "manifest.json"
    # the previous snapshot and the log hold everything; the log loses its last record (its part was
    # renamed into place, the crash came before the record was whole)
    log = tmp_path / "commits.log"
    log.write_bytes(b"\n".join(log.read_bytes().split(b"\n")[:2]) + b"\n")
    assert [p.name for p in Manifest.load(tmp_path, "manifest.json.prev").parts] == ["part-00000.arrow", "part-00001.arrow"]
    if damage == "edited":
        path.write_text(path.read_text().replace('"total_rows":9', '"total_rows":8', 1))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    (tmp_path / "part-00003.arrow").write_bytes(b"ARROW1 torn")  # an unlisted, unreadable part goes

    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=3, total_rows=9)
    assert sink.damaged_manifest and sink.adopted == ["part-00002.arrow"]  # not in .prev, but whole
    assert sink.done.ranges() == [(0, 9)]  # no committed row lost
    assert Manifest.load(tmp_path).done_rows().ranges() == [(0, 9)]  # the rebuilt manifest is committed
    assert "part-00003.arrow" not in files(tmp_path)
    assert ("manifest.json.corrupt" in files(tmp_path)) == (damage != "deleted")
    assert read_results(tmp_path).column("row_index").to_pylist() == list(range(9))


def test_a_manifest_damaged_beyond_repair_is_refused_with_a_way_out(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=1) as sink:
        sink.write(result(0))
        sink.write(result(1))
    (tmp_path / "manifest.json").write_text("{")
    (tmp_path / "manifest.json.prev").write_text("{")
    with pytest.raises(SinkError, match="--restart"):
        ArrowSink(tmp_path, fingerprint=FP)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "manifest.json.prev").unlink()
    with pytest.raises(SinkError, match="part files but no manifest.json"):
        ArrowSink(tmp_path, fingerprint=FP)
    assert clear_results(tmp_path) == 3  # two parts and the log
    assert ArrowSink(tmp_path, fingerprint=FP).done.count() == 0


def test_a_part_with_a_wrong_checksum_is_set_aside_and_its_rows_rerun(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(4):
            sink.write(result(i))
    data = bytearray((tmp_path / "part-00001.arrow").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    (tmp_path / "part-00001.arrow").write_bytes(bytes(data))
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    assert sink.repaired == ["part-00001.arrow"] and sink.done.ranges() == [(0, 2)]
    assert "part-00001.arrow.corrupt" in files(tmp_path)


def test_a_different_job_is_refused(tmp_path):
    ArrowSink(tmp_path, fingerprint=FP, total_rows=10).close()
    with pytest.raises(FingerprintMismatch, match="differs in: temperature"):
        ArrowSink(tmp_path, fingerprint={**FP, "temperature": 0.7})
    with pytest.raises(FingerprintMismatch, match="10 rows"):
        ArrowSink(tmp_path, fingerprint=FP, total_rows=11)
    ArrowSink(tmp_path, fingerprint=dict(reversed(FP.items())), total_rows=10).close()  # same job


def test_extra_is_stored_at_the_next_commit(tmp_path):
    sink = ArrowSink(tmp_path, fingerprint=FP)
    sink.set_extra("jsonl_position", [3, 120])
    assert Manifest.load(tmp_path).extra == {}
    sink.commit()  # no rows buffered: the manifest is still written
    assert Manifest.load(tmp_path).extra["jsonl_position"] == [3, 120]
    assert ArrowSink(tmp_path, fingerprint=FP).extra["jsonl_position"] == [3, 120]


def test_the_resume_position_is_that_of_the_first_row_not_committed(tmp_path):
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    for i in range(6):
        sink.note_position(i, [i, 10 * i])
    sink.write(result(1))
    sink.write(result(0))  # commits rows 0, 1
    sink.sync()
    assert Manifest.load(tmp_path).extra["resume_position"] == [2, 20]
    sink.write(result(3))
    sink.write(result(4))  # row 2 is still running: the position stays at row 2
    sink.sync()
    assert Manifest.load(tmp_path).extra["resume_position"] == [2, 20]
    sink.write(result(2))
    sink.write(result(5))
    sink.sync()
    assert Manifest.load(tmp_path).extra["resume_position"] == [2, 20]  # row 6 was never noted: keep the last
    assert sink._positions == {}  # committed rows are forgotten: memory stays bounded
    sink.set_total_rows(6)
    sink.close()
    assert Manifest.load(tmp_path).total_rows == 6
    part = Manifest.load(tmp_path).parts[0]
    assert (part.errors, part.prompt_tokens, part.completion_tokens) == (0, 6, 1)


def test_a_failed_write_is_an_output_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    sink.write(result(0))
    real_fsync = os.fsync
    monkeypatch.setattr("batchjob.io.disk.os.fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    sink.write(result(1))  # a full part: the writer thread writes it, and fails
    with pytest.raises(OutputError, match="No space left on device.*rerun"):
        sink.sync()
    monkeypatch.setattr("batchjob.io.disk.os.fsync", real_fsync)
    assert files(tmp_path) == ["manifest.json", "manifest.json.prev"]  # no part, no temp file
    with pytest.raises(OutputError):
        sink.commit()  # this sink is done for: the job stops, and its rows run again on resume
    assert ArrowSink(tmp_path, fingerprint=FP).done.ranges() == []


def test_fingerprint_changes_name_the_path_and_both_values():
    old = {"params": {"temperature": 0.0, "top_k": 0}, "input": {"files": [["a.jsonl", 10, 5]]}}
    new = {"params": {"temperature": 0.8, "top_k": 0}, "input": {"files": [["a.jsonl", 12, 6]]}}
    assert fingerprint_changes(old, new) == ['input.files[0]: ["a.jsonl", 10, 5] -> ["a.jsonl", 12, 6]',
                                             "params.temperature: 0.0 -> 0.8"]


def test_write_rejects_duplicates_and_bad_rows(tmp_path):
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    sink.write(result(0))
    with pytest.raises(ValueError, match="already written"):
        sink.write(result(0))  # still buffered
    sink.write(result(1))
    with pytest.raises(ValueError, match="already written"):
        sink.write(result(1))  # committed
    with pytest.raises(ValueError, match="finish_reason"):
        sink.write({**result(2), "finish_reason": "eos"})
    with pytest.raises(SinkError, match="collide"):
        ArrowSink(tmp_path / "x", fingerprint=FP, keep_columns=["error"])


def test_error_rows_are_kept(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP) as sink:
        sink.write({"row_index": 0, "finish_reason": "error", "error": "data.jsonl line 1: invalid JSON"})
    row = read_results(tmp_path).to_pylist()[0]
    assert row["generated_text"] is None and row["error"].startswith("data.jsonl line 1")


def test_kept_column_types_across_parts(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    rows = [
        dict(score=None, tag=1, messages=messages),  # part 0: score all null
        dict(score=1, tag=2, messages=messages),  # part 1: score int
        dict(score=2.5, tag="x", messages=[{"role": "user", "content": "yo", "name": "ann"}]),  # widen / text
        dict(score=3, tag=4, messages=messages),
    ]
    with ArrowSink(tmp_path, fingerprint=FP, keep_columns=["score", "tag", "messages"], part_rows=1) as sink:
        for i, kept in enumerate(rows):
            sink.write(result(i, **kept))
    # A reopened sink keeps widening from the types already on disk.
    with ArrowSink(tmp_path, fingerprint=FP, keep_columns=["score", "tag", "messages"], part_rows=1) as sink:
        sink.write(result(4, score=5, tag=5, messages=messages))

    parts = [pa.ipc.open_file(tmp_path / f"part-0000{i}.arrow").schema for i in range(5)]
    assert [s.field("score").type for s in parts] == [pa.null(), pa.int64(), pa.float64(), pa.float64(), pa.float64()]
    assert [s.field("tag").type for s in parts] == [pa.int64(), pa.int64(), pa.string(), pa.string(), pa.string()]

    table = read_results(tmp_path)
    assert table.schema.field("score").type == pa.float64()
    assert table.column("score").to_pylist() == [None, 1.0, 2.5, 3.0, 5.0]
    assert table.column("tag").to_pylist() == ["1", "2", "x", "4", "5"]  # conflicting types end as text
    assert table.column("messages").to_pylist()[2] == [{"role": "user", "content": "yo", "name": "ann"}]
    assert table.column("messages").to_pylist()[3] == [{"role": "user", "content": "hi", "name": None}]


def test_unusable_output_folder_is_a_sink_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SinkError, match="cannot use output folder"):
        ArrowSink(tmp_path / "file" / "out", fingerprint=FP)


def test_read_results_of_an_empty_job_and_of_no_job(tmp_path):
    ArrowSink(tmp_path / "empty", fingerprint=FP).close()
    assert read_results(tmp_path / "empty").schema == RESULT_SCHEMA
    with pytest.raises(ManifestError, match="no manifest.json"):
        read_results(tmp_path)


def test_show_prints_location_schema_and_rows(tmp_path, capsys):
    from batchjob.cli import show

    with ArrowSink(tmp_path, fingerprint=FP, keep_columns=["prompt"], total_rows=3) as sink:
        sink.write(result(1, prompt="Name a color."))
        sink.write(result(0, prompt="What is the capital of France?"))
    assert show.main([str(tmp_path), "-n", "1"]) == 0
    text = capsys.readouterr().out
    assert str(tmp_path.resolve()) in text and "2 rows of 3" in text
    assert "generated_text: string" in text
    assert "What is the capital of France?" in text and "Name a color." not in text
    assert show.main([str(tmp_path / "nothing")]) == 1


def test_done_rows_come_back_as_row_ranges(tmp_path):
    with ArrowSink(tmp_path, fingerprint=FP, part_rows=3) as sink:
        for i in [0, 1, 2, 10, 11, 5]:
            sink.write(result(i))
    assert Manifest.load(tmp_path).done_rows() == RowRanges([(0, 3), (5, 6), (10, 12)])


def test_a_manifest_of_a_newer_format_is_refused_and_left_alone(tmp_path):
    ArrowSink(tmp_path, fingerprint=FP).close()
    manifest = Manifest.load(tmp_path)
    body = {**{k: v for k, v in manifest.to_json().items() if k != "checksum"}, "version": 4}
    # a newer format may checksum differently: its version is refused before any check
    (tmp_path / "manifest.json").write_text(json.dumps({**body, "checksum": "sha256:unknown"}))
    before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(SinkError, match="version 4"):
        ArrowSink(tmp_path, fingerprint=FP)
    assert (tmp_path / "manifest.json").read_bytes() == before and "manifest.json.corrupt" not in files(tmp_path)


def test_reopening_sizes_every_part_but_hashes_only_the_newest_and_verify_hashes_all(tmp_path):
    from click.testing import CliRunner

    from batchjob.cli.main import main

    with ArrowSink(tmp_path, fingerprint=FP, part_rows=2) as sink:
        for i in range(10):
            sink.write(result(i))
    part = tmp_path / "part-00001.arrow"
    data = bytearray(part.read_bytes())
    data[-20] ^= 0xFF  # the same size, other bytes: only a hash sees it
    part.write_bytes(bytes(data))
    assert ArrowSink(tmp_path, fingerprint=FP).repaired == []  # an old part: sized, not hashed
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and "part-00001.arrow: damaged (SHA-256 mismatch)" in r.output and "--repair" in r.output
    r = CliRunner().invoke(main, ["verify", str(tmp_path), "--repair"])
    assert r.exit_code == 1 and "set aside" in r.output
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=2)
    assert sink.repaired == ["part-00001.arrow"] and sink.done.ranges() == [(0, 2), (4, 10)]
    sink.write(result(2))
    sink.write(result(3))
    sink.close()
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 0 and "every part whole" in r.output
    newest = tmp_path / Manifest.load(tmp_path).parts[-1].name
    data = bytearray(newest.read_bytes())
    data[-20] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert ArrowSink(tmp_path, fingerprint=FP).repaired == [newest.name]  # the newest are hashed on reopening


def test_parquet_parts_are_committed_read_and_verified_like_arrow_ones(tmp_path):
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from batchjob.cli.main import main

    with ArrowSink(tmp_path, fingerprint=FP, keep_columns=["id"], part_rows=3, part_format="parquet") as sink:
        for i in range(7):
            sink.write(result(i, id=f"r{i}"))
    names = [p.name for p in Manifest.load(tmp_path).parts]
    assert names == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert pq.read_table(tmp_path / names[0]).column("id").to_pylist() == ["r0", "r1", "r2"]  # any Parquet reader
    assert read_results(tmp_path).column("row_index").to_pylist() == list(range(7))
    assert CliRunner().invoke(main, ["verify", str(tmp_path)]).exit_code == 0
    r = CliRunner().invoke(main, ["export", str(tmp_path), "--to", str(tmp_path / "x" / "all.jsonl"), "--partial"])
    assert r.exit_code == 0, r.output
    assert len((tmp_path / "x" / "all.jsonl").read_text().splitlines()) == 7
    with ArrowSink(tmp_path, fingerprint=FP, keep_columns=["id"], part_rows=3) as sink:  # a later run: Arrow parts
        sink.write(result(7, id="r7"))
    assert read_results(tmp_path).column("id").to_pylist()[-1] == "r7"


def test_the_writer_thread_never_loses_or_doubles_a_row(tmp_path):
    sink = ArrowSink(tmp_path, fingerprint=FP, part_rows=3)
    for i in range(100):
        sink.write(result(i))
        with pytest.raises(ValueError, match="already written"):
            sink.write(result(i))  # buffered, handed to the writer, or committed: a second write is refused
    sink.close()
    manifest = Manifest.load(tmp_path)
    assert manifest.done_rows().ranges() == [(0, 100)] and sum(p.num_rows for p in manifest.parts) == 100
