"""Manifest: which part files of an output folder are committed, and what the job knows about them.

The state is manifest.json, a snapshot up to commit `seq`, plus the commit log's records after it
(io/commit_log.py): a part counts once its record is in the log (or the snapshot). `commit` writes a
new snapshot atomically (a compaction: the log it absorbs becomes commits.log.prev) and keeps the
snapshot before it as manifest.json.prev, so damage to manifest.json (a bad disk, an editor, a copy cut
short) is repaired from the previous snapshot and the logs. Snapshots of version 1 (batchjob 0.1, no
log) load as the state at seq 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchjob.io.commit_log import LOG, LOG_PREV, LogError, fsync_dir, read
from batchjob.io.ranges import RowRanges

MANIFEST = "manifest.json"
PREVIOUS = "manifest.json.prev"
VERSION = 2  # 2: a snapshot with `seq` and a commit log beside it; 1 (read too): the whole state, no log
READS = (1, 2)


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

    def apply(self, record: dict) -> None:
        """One commit-log record: its part, the extra keys it set, the row count once known."""
        if record.get("part") is not None:
            self.parts.append(PartEntry(**record["part"]))
        self.extra.update(record.get("extra") or {})
        if "total_rows" in record:
            self.total_rows = record["total_rows"]
        self.seq = record["seq"]

    def done_rows(self) -> RowRanges:
        done = RowRanges()
        for part in self.parts:
            for start, end in part.rows:
                done.add(start, end)
        return done

    def num_rows(self) -> int:
        return sum(part.num_rows for part in self.parts)

    def totals(self) -> dict:
        """Rows, errors and tokens of the committed parts."""
        return {"rows": self.num_rows(), "errors": sum(p.errors for p in self.parts),
                "prompt_tokens": sum(p.prompt_tokens for p in self.parts),
                "completion_tokens": sum(p.completion_tokens for p in self.parts)}

    def to_json(self) -> dict:
        body = {
            "version": VERSION,
            "seq": self.seq,
            "fingerprint": self.fingerprint,
            "total_rows": self.total_rows,
            "parts": [asdict(part) for part in self.parts],
            "extra": self.extra,
        }
        return {**body, "checksum": _checksum(body)}

    @classmethod
    def from_json(cls, data: dict, *, where: str = MANIFEST) -> Manifest:
        if not isinstance(data, dict) or "checksum" not in data:
            raise ManifestError(f"{where} has no checksum field; it was not written by batchjob")
        body = {k: v for k, v in data.items() if k != "checksum"}
        if _checksum(body) != data["checksum"]:
            raise ManifestError(f"{where} is corrupt (checksum mismatch); it was edited or damaged — "
                                "restore it or rerun into a new output folder")
        if body.get("version") not in READS:
            raise ManifestVersionError(f"{where} has version {body.get('version')}; this batchjob reads versions "
                                       f"{', '.join(map(str, READS))}")
        try:
            return cls(
                fingerprint=body["fingerprint"],
                parts=[PartEntry(**part) for part in body["parts"]],
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
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"{path} is corrupt (not valid JSON: {e}); restore it or rerun into a new output folder") from e
        manifest = cls.from_json(data, where=str(path))
        try:
            for log in (LOG_PREV, LOG):  # the older log first: a record is applied once, in seq order
                for record in read(out_dir / log)[0]:
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
        data = json.dumps(self.to_json(), indent=None, separators=(",", ":"), ensure_ascii=False).encode()
        path = out_dir / MANIFEST
        if path.exists():
            keep_previous(path, out_dir / PREVIOUS)
        atomic_write(path, data)
        if not (out_dir / PREVIOUS).exists():  # the first snapshot: with the logs, it rebuilds any later state
            atomic_write(out_dir / PREVIOUS, data)  # a copy, not a link: damage to one must not reach the other
        if (out_dir / LOG).exists():  # every record in it is in the snapshot now
            os.replace(out_dir / LOG, out_dir / LOG_PREV)
            fsync_dir(out_dir)
        return len(data)


def keep_previous(path: Path, prev: Path) -> None:
    if prev.exists() and os.path.samefile(path, prev):
        return  # already kept (a commit that failed after this step); rename() would keep the temp link
    tmp = prev.with_name(f".{prev.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # no hard links on this filesystem: copy
        atomic_write(prev, path.read_bytes())
        return
    os.replace(tmp, prev)


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
    """Write a temp file beside `path`, fsync, rename over `path`, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave nothing half-written behind
        raise
    fsync_dir(path.parent)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _checksum(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
