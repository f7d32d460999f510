"""The disk layer (batchjob/io/disk.py): every byte a job persists goes through it, its errors are never
swallowed, and the two gaps found on main stay fixed (a folder fsync's EIO was swallowed; `export` renamed
its files into place without syncing their folder)."""
from __future__ import annotations

import ast
import errno
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.disk import Disk, File, using
from tests.durability.recorder import RecordingDisk

PACKAGE = Path(__file__).resolve().parents[2] / "batchjob"
OUTSIDE = {"bench"}  # benchmarks write their own caches and reports, never a job's output
WRITES_BY_NAME = {"write_text", "write_bytes", "unlink", "rename", "touch", "mkdir", "rmdir", "symlink_to",
                  "hardlink_to"}
OS_WRITES = {"replace", "rename", "renames", "fsync", "fdatasync", "link", "symlink", "unlink", "remove", "write",
             "pwrite", "ftruncate", "truncate", "mkdir", "makedirs", "rmdir", "removedirs"}
SHUTIL_WRITES = {"move", "copy", "copy2", "copyfile", "copytree", "copyfileobj", "rmtree"}
LAYER = {"disk", "layer"}  # how the package names the layer: disk().unlink(...), layer.rename(...)
# writes the scan flags that stay outside the layer, and why
ALLOWED: dict[tuple[str, str], str] = {
    ("batchjob/job/process/signals.py", "os.write"): "a signal handler's line to stderr (fd 2), not a file",
    ("batchjob/job/streams.py", ".rmdir()"): "takes back an empty folder a failed start made; if a crash keeps it, "
                                             "the next run uses it",
}


def writes_around_the_layer(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        what = None
        if isinstance(f, ast.Name) and f.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                what = f"open(..., {mode.value!r})"
        elif isinstance(f, ast.Attribute):
            receiver = f.value.func if isinstance(f.value, ast.Call) else f.value
            if isinstance(receiver, ast.Name) and receiver.id in LAYER:
                continue  # through the layer
            if isinstance(f.value, ast.Name) and f.value.id in ("os", "shutil"):
                if f.attr in (SHUTIL_WRITES if f.value.id == "shutil" else OS_WRITES):
                    what = f"{f.value.id}.{f.attr}"
                elif f.attr == "open" and any(isinstance(a, ast.Attribute) and a.attr in ("O_WRONLY", "O_RDWR", "O_CREAT")
                                              for arg in node.args[1:2] for a in ast.walk(arg)):
                    what = "os.open for writing"
            elif f.attr in WRITES_BY_NAME:
                what = f".{f.attr}()"
        rel = str(path.relative_to(root))
        if what and (rel, what) not in ALLOWED:
            found.append(f"{rel}:{node.lineno}: {what}")
    return found


def test_nothing_in_the_package_writes_a_file_around_the_disk_layer():
    files = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in OUTSIDE
             and p != PACKAGE / "io" / "disk.py"]
    assert len(files) > 100
    found = [hit for p in files for hit in writes_around_the_layer(p)]
    assert not found, "writes that bypass batchjob/io/disk.py:\n" + "\n".join(found)


def test_the_scan_sees_each_kind_of_write(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os, shutil\nopen('a', 'w')\nopen('a', mode='ab')\nos.replace('a', 'b')\n"
                      "os.open('a', os.O_WRONLY)\np.write_text('x')\np.unlink()\nshutil.move('a', 'b')\n"
                      "open('a')\nopen('a', 'rb')\n'x'.replace('a', 'b')\nos.open('a', os.O_RDONLY)\n")
    hits = writes_around_the_layer(sample, root=tmp_path)
    assert [h.split(": ", 1)[1] for h in hits] == ["open(..., 'w')", "open(..., 'ab')", "os.replace", "os.open for writing",
                                                   ".write_text()", ".unlink()", "shutil.move"]


# gap 1: a folder fsync's error was swallowed, and the job exited 0 as if its commits were durable


def fail_folder_fsyncs(monkeypatch, code: int) -> list[int]:
    """os.fsync raises `code` on folders (as a disk that fails, or a file system without folder fsync)."""
    real, failed = os.fsync, []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            failed.append(fd)
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


def test_an_eio_from_a_folder_fsync_fails_the_job_with_one_line_and_a_rerun_completes(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    model = tiny_model_dir("llama", max_positions=256)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "Row {i} says"}}\n' for i in range(12)))
    args = ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "out"), "--max-tokens", "3",
            "--part-rows", "4", "--no-progress", "--kv-cache-gb", "0.02", "--dtype", "float32"]
    failed = fail_folder_fsyncs(monkeypatch, errno.EIO)
    result = CliRunner().invoke(main, args)
    assert failed and result.exit_code == 1, result.output  # it was 0: the EIO was swallowed
    errors = [line for line in result.output.splitlines() if line.startswith("batchjob: error")]
    assert len(errors) == 1 and "Input/output error" in errors[0] and "internal error" not in errors[0], result.output
    monkeypatch.undo()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "12 rows" in result.output, result.output


def test_a_file_system_without_folder_fsync_is_no_error(tmp_path, monkeypatch):
    fail_folder_fsyncs(monkeypatch, errno.EINVAL)
    Disk().write_atomic(tmp_path / "a.json", b"{}")  # EINVAL: nothing to sync there, as before
    assert (tmp_path / "a.json").read_bytes() == b"{}"
    fail_folder_fsyncs(monkeypatch, errno.EIO)
    with pytest.raises(OSError, match="Input/output error"):
        Disk().write_atomic(tmp_path / "b.json", b"{}")


# gap 2: `batchjob export` renamed its result and errors files into place without syncing their folder


def renamed_then_synced(layer: RecordingDisk, target: Path) -> bool:
    """`target` was renamed into place and its folder fsynced after that."""
    ops = [(op.kind, op.to if op.kind == "rename" else op.path) for op in layer.recording.ops]
    target = target.resolve()
    name = str(target.relative_to(layer.root))
    renames = [i for i, op in enumerate(ops) if op == ("rename", name)]
    folder = "" if target.parent == layer.root else str(target.parent.relative_to(layer.root))
    return bool(renames) and ("fsync_dir", folder) in ops[renames[-1]:]


def test_every_export_syncs_the_folder_it_renames_its_files_into(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_positions=256)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"prompt": "Row {i} says"}}\n' for i in range(3)))
    out, runner = tmp_path / "out", CliRunner()
    common = ["--model", str(model), "--max-tokens", "2", "--no-progress", "--kv-cache-gb", "0.02"]
    assert runner.invoke(main, ["run", *common, "--input", str(src), "--output", str(out),
                                "--output-format", "openai-batch"]).exit_code == 0
    for args, targets in (
        (["export", str(out), "--to", str(tmp_path / "rows" / "all.parquet")], [tmp_path / "rows" / "all.parquet"]),
        (["export", str(out), "--format", "openai-batch", "--to", str(tmp_path / "oa" / "responses.jsonl")],
         [tmp_path / "oa" / "responses.jsonl", tmp_path / "oa" / "responses.errors.jsonl"]),
    ):
        layer = RecordingDisk(tmp_path)
        with using(layer):
            result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        for target in targets:
            assert renamed_then_synced(layer, target), (target, layer.recording.ops)
    (out / "results.jsonl").unlink()  # the job's own response files, written again by a rerun
    layer = RecordingDisk(tmp_path)
    with using(layer):
        assert runner.invoke(main, ["run", *common, "--input", str(src), "--output", str(out),
                                    "--output-format", "openai-batch"]).exit_code == 0
    assert all(renamed_then_synced(layer, out / name) for name in ("results.jsonl", "errors.jsonl")), layer.recording.ops


def test_a_file_of_the_layer_feeds_pyarrow_writers_and_write_atomic_leaves_nothing_on_failure(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"x": list(range(1000))})
    with File(Disk(), tmp_path / "t.parquet") as f:
        pq.write_table(table, f)
        f.sync()
    assert pq.read_table(tmp_path / "t.parquet").equals(table)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        Disk().write_atomic(tmp_path / "t.parquet", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]  # the old file, no temp
    assert pq.read_table(tmp_path / "t.parquet").equals(table)
