"""Manifest: which part files of an output folder are committed, and what the job knows about them.

The state is manifest.json, a snapshot up to commit `seq`, plus the commit log's records after it
(io/commit_log.py): a part counts once its record is in the log (or the snapshot). `commit` writes a
new snapshot atomically (a compaction: the log it absorbs becomes commits.log.prev) and keeps the
snapshot before it as manifest.json.prev, so damage to manifest.json (a bad disk, an editor, a copy cut
short) is repaired from the previous snapshot and the logs. Snapshots of version 1 (batchjob 0.1, no
log) load as the state at seq 0.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.io.commit_log import LOG, LOG_PREV, LogError, read
from batchjob.io.disk import disk
from batchjob.io.ranges import RowRanges

MANIFEST = "manifest.json"
PREVIOUS = "manifest.json.prev"
VERSION = 3  # 3: as 2, checksummed over the bytes as written (no re-encoding to verify a large snapshot)
READS = (1, 2, 3)  # 2: a snapshot with `seq` and a commit log beside it; 1: the whole state, no log
_HEAD = b'{"checksum":"sha256:'  # a version-3 file: this, 64 hex digits, '",', then the rest of the object
_HEAD_LEN = len(_HEAD) + 64 + 2


class ManifestError(Exception):
    """manifest.json is unreadable, corrupt, or belongs to another job."""


class ManifestVersionError(ManifestError):
    """manifest.json is intact but in a format this batchjob does not read (a newer one wrote it)."""


@dataclass(slots=True)
class PartEntry:
    name: str  # file name inside the output folder, e.g. part-00003.arrow
    num_rows: int
    rows: list[list[int]]  # row_index ranges [[start, end), ...] held by the part
    bytes: int
    sha256: str
    created: str  # UTC, ISO 8601
    # what the part holds, so `status` needs no part file (absent in manifests of batchjob <= 0.1)
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def row_ranges(self) -> RowRanges:
        return RowRanges.from_json(self.rows)


@dataclass(slots=True)
class Manifest:
    fingerprint: dict
    parts: list[PartEntry] = field(default_factory=list)
    total_rows: int | None = None
    extra: dict = field(default_factory=dict)  # free-form: resume offsets, stats
    version: int = VERSION
    seq: int = 0  # the last commit this state includes
    log_bytes: int | None = None  # the valid length of commits.log when loaded (not stored): its writer needs no re-read

    def apply(self, record: dict) -> None:
        """One commit-log record: its part, the extra keys it set, the row count once known."""
        if record.get("part") is not None:
            self.parts.append(PartEntry(**record["part"]))
        self.extra.update(record.get("extra") or {})
        if "total_rows" in record:
            self.total_rows = record["total_rows"]
        self.seq = record["seq"]

    def done_rows(self) -> RowRanges:
        return RowRanges.merged(r for part in self.parts for r in part.rows)

    def num_rows(self) -> int:
        return sum(part.num_rows for part in self.parts)

    def totals(self) -> dict:
        """Rows, errors and tokens of the committed parts."""
        return {"rows": self.num_rows(), "errors": sum(p.errors for p in self.parts),
                "prompt_tokens": sum(p.prompt_tokens for p in self.parts),
                "completion_tokens": sum(p.completion_tokens for p in self.parts)}

    def _body(self) -> dict:
        # parts as columns (one list per field): a 100,000-part snapshot parses in a fraction of the time
        parts = {f: [getattr(p, f) for p in self.parts] for f in PART_FIELDS}
        return {"version": VERSION, "seq": self.seq, "fingerprint": self.fingerprint, "total_rows": self.total_rows,
                "parts": parts, "extra": self.extra}

    def encode(self) -> bytes:
        """The snapshot file: the state as compact JSON, its first field the SHA-256 of every byte after it."""
        rest = json.dumps(self._body(), separators=(",", ":"), ensure_ascii=False).encode()[1:]
        return _HEAD + hashlib.sha256(rest).hexdigest().encode() + b'",' + rest

    def to_json(self) -> dict:
        return json.loads(self.encode())

    @classmethod
    def from_json(cls, data: dict, *, where: str = MANIFEST, raw: bytes | None = None) -> Manifest:
        """The state from a parsed snapshot. Version 3 is verified against `raw` (the file's bytes), versions 1
        and 2 against their canonical re-encoding; a newer version is refused before any check."""
        if not isinstance(data, dict) or "checksum" not in data:
            raise ManifestError(f"{where} has no checksum field; it was not written by batchjob")
        if data.get("version") not in READS:
            raise ManifestVersionError(f"{where} has version {data.get('version')}; this batchjob reads versions "
                                       f"{', '.join(map(str, READS))}")
        body = {k: v for k, v in data.items() if k != "checksum"}
        if data["version"] >= 3:
            ok = (raw is not None and raw.startswith(_HEAD) and raw[_HEAD_LEN - 2:_HEAD_LEN] == b'",'
                  and "sha256:" + hashlib.sha256(raw[_HEAD_LEN:]).hexdigest() == data["checksum"])
        else:
            ok = _checksum(body) == data["checksum"]
        if not ok:
            raise ManifestError(f"{where} is corrupt (checksum mismatch); it was edited or damaged — "
                                "restore it or rerun into a new output folder")
        try:
            return cls(
                fingerprint=body["fingerprint"],
                parts=_parts(body["parts"]),
                total_rows=body["total_rows"],
                extra=body["extra"],
                version=body["version"],
                seq=body.get("seq", 0),
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{where} lacks a field or has an unknown one: {e}") from e

    @classmethod
    def load(cls, out_dir: str | Path, name: str = MANIFEST) -> Manifest | None:
        """The committed state of `out_dir`: the snapshot `name` (manifest.json, or its previous generation)
        plus the commit-log records after it; None when there is no snapshot."""
        out_dir = Path(out_dir)
        path = out_dir / name
        try:
            text = path.read_bytes()
        except FileNotFoundError:
            return None
        collecting = gc.isenabled()
        gc.disable()  # ~300,000 objects for 100,000 parts: collector passes over them would triple the load time
        try:
            return cls._replay(out_dir, name, path, text)
        finally:
            if collecting:
                gc.enable()

    @classmethod
    def _replay(cls, out_dir: Path, name: str, path: Path, text: bytes) -> Manifest:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"{path} is corrupt (not valid JSON: {e}); restore it or rerun into a new output folder") from e
        manifest = cls.from_json(data, where=str(path), raw=text)
        try:
            current, manifest.log_bytes = read(out_dir / LOG)
            logs = [(LOG, current)]
            if name != MANIFEST or (current and current[0]["seq"] > manifest.seq + 1):
                # commits.log.prev holds what the compaction after this snapshot absorbed: needed from the
                # previous snapshot (or to report a gap), never from manifest.json itself
                logs.insert(0, (LOG_PREV, read(out_dir / LOG_PREV)[0]))
            for log, records in logs:  # the older log first: a record is applied once, in seq order
                for record in records:
                    if record["seq"] <= manifest.seq:
                        continue  # already in the snapshot
                    if record["seq"] != manifest.seq + 1:
                        raise ManifestError(f"{out_dir / log}: commits {manifest.seq + 1}-{record['seq'] - 1} are "
                                            f"missing after {name}")
                    manifest.apply(record)
        except LogError as e:
            raise ManifestError(str(e)) from e
        return manifest

    def commit(self, out_dir: str | Path) -> int:
        """Write the whole state as a new snapshot (a compaction), atomically and durably: the replaced one
        stays as manifest.json.prev (a hard link: no copy) and the log it absorbed becomes commits.log.prev.
        Returns the snapshot's size in bytes."""
        out_dir = Path(out_dir)
        data = self.encode()
        path = out_dir / MANIFEST
        if path.exists():
            keep_previous(path, out_dir / PREVIOUS)
        atomic_write(path, data)
        if not (out_dir / PREVIOUS).exists():  # the first snapshot: with the logs, it rebuilds any later state
            atomic_write(out_dir / PREVIOUS, data)  # a copy, not a link: damage to one must not reach the other
        if (out_dir / LOG).exists():  # every record in it is in the snapshot now
            layer = disk()
            layer.rename(out_dir / LOG, out_dir / LOG_PREV)
            layer.fsync_dir(out_dir)
        return len(data)


def keep_previous(path: Path, prev: Path) -> None:
    """`prev` becomes the snapshot `path` is now (a hard link; a copy where links are refused). Not synced
    here: the new snapshot's rename and its folder's fsync, which follow, make it durable too."""
    if prev.exists() and os.path.samefile(path, prev):
        return  # already kept (a commit that failed after this step); rename() would keep the temp link
    layer = disk()
    tmp = prev.with_name(f".{prev.name}.tmp")
    if tmp.exists():
        layer.unlink(tmp)
    try:
        layer.link(path, tmp)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise  # an I/O error is an error, not a file system without hard links
        atomic_write(prev, path.read_bytes())  # no hard links on this filesystem: copy
        return
    layer.rename(tmp, prev)


def result_folders(root: str | Path) -> list[Path]:
    """`root` and every folder below it that holds committed results (a manifest), sorted: a job's
    folder, its per-lane folders (OUTPUT/<lane>/) and shard folders (OUTPUT/shard-K-of-N/...)."""
    root = Path(root)
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if MANIFEST in files or PREVIOUS in files:
            found.append(Path(folder))
    return sorted(found)


def atomic_write(path: Path, data: bytes) -> None:
    """Write a temp file beside `path`, fsync, rename over `path`, fsync the folder (io/disk.py)."""
    disk().write_atomic(path, data)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


PART_FIELDS = tuple(PartEntry.__slots__)


def _parts(data: list | dict) -> list[PartEntry]:
    """Version 3 stores parts as columns, versions 1 and 2 as one object per part."""
    if isinstance(data, list):
        return [PartEntry(**part) for part in data]
    if not isinstance(data, dict) or set(data) != set(PART_FIELDS) or len({len(v) for v in data.values()}) > 1:
        raise TypeError(f"parts must have the columns {', '.join(PART_FIELDS)} of equal length")
    return [PartEntry(*values) for values in zip(*(data[f] for f in PART_FIELDS))]


def _checksum(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
