"""ArrowSink: writes result rows into an output folder as part files (Arrow IPC, or Parquet) and commits
each one with a record in the commit log (io/commit_log.py).

Commit protocol: a part is written under a temp name, fsynced and renamed, then one record listing it
is appended to the commit log and fsynced; when the log outgrows manifest.json, a new snapshot replaces
it. Only listed parts count, so a crash anywhere loses at most the rows not committed yet, and
reopening the folder sweeps away what the crash left behind (io/recovery.py).

Rows are buffered column by column; a part is built as Arrow arrays, written and fsynced on a writer
thread, so the engine does not wait for the disk (unless WRITE_BEHIND parts are already waiting). A
failed write (a full disk) is raised by the next call into the sink. `done` holds committed rows only.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from batchjob.io.commit_log import CommitLog
from batchjob.io.disk import disk
from batchjob.io.manifest import MANIFEST, VERSION, Manifest
from batchjob.io.part_writer import PartWriter, output_error
from batchjob.io.parts import FINISH_REASONS, PART_FORMATS, RESULT_SCHEMA
from batchjob.io.ranges import RowRanges
from batchjob.io.recovery import SinkError, check_same_job, load_manifest, recover

RESUME_POSITION = "resume_position"  # manifest extra: where a reader resumes (first row not committed)
INPUT_PATH = "input_path"  # extra: the input the rows were read from (`show` reads prompts there by row index)
COMPACT_MIN_BYTES = 256 << 10  # the log is folded into a new snapshot once it is larger than this and the snapshot
WRITE_BEHIND = 2  # parts handed to the writer thread and not yet committed, at most


@dataclass(slots=True)
class _Commit:
    """What one commit hands to the writer thread."""
    columns: dict[str, list] | None  # the part's rows, column by column; None: a record without a part
    rows: RowRanges
    extra: dict  # manifest extra keys set since the last commit
    total_rows: object  # the input's row count once known, or _UNCHANGED


_UNCHANGED = object()
_REASONS = frozenset(FINISH_REASONS)


class ArrowSink:
    def __init__(self, out_dir: str | Path, *, fingerprint: dict, keep_columns: Iterable[str] = (),
                 part_rows: int = 1000, part_seconds: float = 30.0, total_rows: int | None = None,
                 part_format: str = "arrow", column_types: dict | None = None) -> None:
        """`column_types`: kept columns of a fixed Arrow type (the others take their values' type)."""
        self.out_dir = Path(out_dir)
        self.keep_columns = list(keep_columns)
        clash = [c for c in self.keep_columns if c in RESULT_SCHEMA.names]
        if clash:
            raise SinkError(f"keep_columns {clash} collide with result columns {RESULT_SCHEMA.names}; "
                            "rename those input columns or do not keep them")
        if part_format not in PART_FORMATS:
            raise SinkError(f"part_format {part_format!r} is not one of {', '.join(PART_FORMATS)}")
        self.part_rows, self.part_seconds, self.part_format = part_rows, part_seconds, part_format
        try:
            disk().mkdir(self.out_dir)
            manifest, self.damaged_manifest = load_manifest(self.out_dir)
        except OSError as e:
            raise SinkError(f"cannot use output folder {self.out_dir}: {e}") from e

        fingerprint = json.loads(json.dumps(fingerprint))  # compare as it will read back
        fresh = manifest is None
        upgraded = False
        if manifest is None:
            manifest = Manifest(fingerprint=fingerprint, total_rows=total_rows)
        else:
            upgraded = check_same_job(self.out_dir, manifest, fingerprint, total_rows)
            manifest.total_rows = manifest.total_rows if total_rows is None else total_rows
        self.manifest = manifest
        # names of listed parts that were missing or damaged; with a damaged manifest, the parts adopted
        self.repaired, self.adopted, next_part = recover(self.out_dir, manifest, adopt=self.damaged_manifest is not None)

        self.done: RowRanges = manifest.done_rows()  # committed rows only
        self._names = [*RESULT_SCHEMA.names, *self.keep_columns]
        self._columns: dict[str, list] = {name: [] for name in self._names}
        self._pending = RowRanges()  # buffered here
        self._written = self.done.copy()  # committed, with the writer, or buffered: any row written (main thread)
        self._handed: deque[_Commit] = deque()  # with the writer, not committed yet (the writer pops them)
        self._first_buffered_at: float | None = None
        self._extra: dict = {}  # set since the last commit
        self._total = _UNCHANGED
        self._closed = False
        self._positions: dict[int, object] = {}  # row read but not committed -> where reading it again starts
        last = self.out_dir / manifest.parts[-1].name if manifest.parts else None
        self._parts = PartWriter(self.out_dir, self.keep_columns, part_format, next_part, last, column_types)
        self._log = CommitLog(self.out_dir, manifest.log_bytes)  # cuts off a torn last record
        snapshot = self.out_dir / MANIFEST
        self._snapshot_bytes = snapshot.stat().st_size if snapshot.exists() else 0
        self._queue: queue.Queue[_Commit | None] = queue.Queue(maxsize=WRITE_BEHIND)
        self._writer: threading.Thread | None = None
        self._failure: BaseException | None = None
        if fresh or self.repaired or self.damaged_manifest or upgraded or manifest.version != VERSION:
            # marks the folder as this job's before any part exists; an older format is written anew
            self._compact()

    # writing

    def write(self, row: dict) -> None:
        """Buffer one result row (result fields plus the kept input columns, by name)."""
        if self._closed:
            raise ValueError("write() after close()")
        self._raise_failure()
        index = row.get("row_index")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"result row needs a non-negative int row_index, got {index!r}")
        if index in self._written:
            raise ValueError(f"row {index} was already written to {self.out_dir}")
        if row.get("finish_reason") not in _REASONS:
            raise ValueError(f"row {index}: finish_reason {row.get('finish_reason')!r} is not one of {FINISH_REASONS}")
        for name, column in self._columns.items():
            column.append(row.get(name))
        self._written.add_row(index)
        self._pending.add_row(index)
        if self._first_buffered_at is None:
            self._first_buffered_at = time.monotonic()
        if len(self._columns["row_index"]) >= self.part_rows:
            self._commit(wait=False)
        else:
            self.commit_if_due()

    def commit_if_due(self) -> None:
        """Commit when part_seconds have passed since the oldest buffered row; call while idle."""
        if self._first_buffered_at is not None and time.monotonic() - self._first_buffered_at >= self.part_seconds:
            self._commit(wait=False)

    def set_extra(self, key: str, value) -> None:
        """Stored in the manifest at the next commit (e.g. a JSONL resume offset, stats)."""
        self._extra[key] = value

    @property
    def extra(self) -> dict:
        """The manifest's extra as it will be after the next commit."""
        handed = tuple(self._handed)
        merged = dict(self.manifest.extra)
        for job in handed:
            merged.update(job.extra)
        merged.update(self._extra)
        return merged

    def set_total_rows(self, total: int) -> None:
        """The input's row count once known (a JSONL file read to its end); stored at the next commit."""
        if self.manifest.total_rows != total:
            self._total = total

    def note_position(self, row_index: int, position) -> None:
        """Where a reader starts to read `row_index` again (JSON-able, opaque here: a JSONL
        (row, byte offset)). Each commit stores the position of the first row not committed as
        extra["resume_position"]. Held only until the row is handed to the writer, so memory stays
        bounded by the rows in flight plus one part."""
        self._positions[row_index] = position

    def commit(self) -> None:
        """Commit what is buffered and wait until every commit so far is durable."""
        self._commit(wait=True)

    def _commit(self, wait: bool) -> None:
        self._raise_failure()
        buffered = bool(self._columns["row_index"])
        if buffered or self._extra or self._total is not _UNCHANGED:
            rows = self._pending
            position = self._positions.get(self._written.first_missing())
            extra = {**self._extra, "last_commit": time.time()}
            if position is not None:
                extra[RESUME_POSITION] = position
            job = _Commit(self._columns if buffered else None, rows, extra, self._total)
            for start, end in rows.ranges():
                for row in range(start, end):
                    self._positions.pop(row, None)
            self._columns = {name: [] for name in self._names}
            self._pending, self._extra, self._total = RowRanges(), {}, _UNCHANGED
            self._first_buffered_at = None
            self._handed.append(job)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=f"batchjob-sink-{self.out_dir.name}",
                                                daemon=True)
                self._writer.start()
            self._queue.put(job)  # blocks only while WRITE_BEHIND parts are waiting for the disk
        if wait:
            self.sync()

    def sync(self) -> None:
        """Wait until every commit handed to the writer is durable (or raise its error); buffers stay."""
        self._queue.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def record_after_failure(self, key: str, value) -> bool:
        """After the writer failed (a full disk, say): store `value` as extra[key] in one small commit-log
        record, no part, so `batchjob status` can say why the job stopped. Best effort: False when the
        disk refuses that too (the log is left as it was)."""
        self._queue.join()  # the writer is idle: it skips every job after its failure
        size = self._log.path.stat().st_size if self._log.path.exists() else 0
        if size != self._log.bytes:
            return False
        try:
            self._log.append({"seq": self.manifest.seq + 1, "extra": {key: value}})
        except OSError:
            return False
        self.manifest.extra = {**self.manifest.extra, key: value}
        self.manifest.seq += 1
        return True

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.commit()
        finally:
            self._closed = True
            if self._writer is not None:
                self._queue.put(None)
                self._writer.join()

    def __enter__(self) -> ArrowSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # buffered rows are finished results: keep them even when the job fails

    # the writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._failure is None:  # after a failure nothing more is committed: the job stops
                    self._write(job)
            except BaseException as e:  # noqa: BLE001 - handed to the caller at its next call
                self._failure = e
            finally:
                self._queue.task_done()

    def _write(self, job: _Commit) -> None:
        record: dict = {"seq": self.manifest.seq + 1, "extra": job.extra}
        if job.total_rows is not _UNCHANGED:
            record["total_rows"] = job.total_rows
        entry = self._parts.write(job.columns, job.rows) if job.columns is not None else None
        if entry is not None:
            record["part"] = asdict(entry)
        try:
            self._log.append(record)
        except OSError as e:
            raise output_error(self._log.path, e) from e  # a written part stays an orphan, removed on resume
        manifest = self.manifest
        if entry is not None:
            manifest.parts.append(entry)  # no copy: readers elsewhere only take len() or iterate once
        manifest.extra = {**manifest.extra, **job.extra}
        if job.total_rows is not _UNCHANGED:
            manifest.total_rows = job.total_rows
        manifest.seq += 1
        self.done = self.done.union(job.rows)
        self._handed.popleft()
        if self._log.bytes > max(COMPACT_MIN_BYTES, self._snapshot_bytes):
            self._compact()  # the commit above is durable already: a failure here loses nothing

    def _compact(self) -> None:
        try:
            self._snapshot_bytes = self.manifest.commit(self.out_dir)
        except OSError as e:
            raise output_error(self.out_dir / MANIFEST, e) from e
        self._log = CommitLog(self.out_dir)  # the old one became commits.log.prev
