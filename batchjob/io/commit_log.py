"""The commit log: what each commit changed, one checksummed JSON line per commit, appended and fsynced.

A commit costs one appended record (a part's entry, the extra keys that changed, the row count once
known), not a rewrite of every part listed before: the bytes written grow with the number of parts,
not with its square. manifest.json is a snapshot of the state up to a record's sequence number
(`seq`); loading replays the records after it. When the log outgrows the snapshot it is compacted into a
new snapshot and kept as commits.log.prev, which with manifest.json.prev rebuilds the state should
manifest.json be damaged.

A crash can tear only the last record (an append cut short): it fails its checksum and is ignored, and
the next writer cuts it off before appending. A bad record with good ones after it is damage, not a
crash, and is reported.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchjob.io.disk import File, disk

LOG = "commits.log"
LOG_PREV = "commits.log.prev"


class LogError(Exception):
    """A record before the last one is damaged (not a torn append)."""


def encode(record: dict) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(body.encode()).hexdigest()[:32]
    return f'{{"sha256":"{digest}","record":{body}}}\n'.encode()


_HEAD = b'{"sha256":"'
_BODY_AT = len(_HEAD) + 32 + len(b'","record":')


def _verified_body(line: bytes) -> bytes | None:
    """The record's JSON as encode() wrote it, when its digest (over these very bytes) matches."""
    body = line[_BODY_AT:-1]
    if line.startswith(_HEAD) and line.endswith(b"}") and hashlib.sha256(body).hexdigest()[:32].encode() == line[len(_HEAD):len(_HEAD) + 32]:
        return body
    return None


def _record(value) -> dict | None:
    return value if isinstance(value, dict) and isinstance(value.get("seq"), int) else None


def _decode(line: bytes) -> dict | None:
    body = _verified_body(line)
    if body is not None:
        try:
            record = _record(json.loads(body))
            if record is not None:
                return record
        except ValueError:
            pass
    try:  # written some other way (re-encoded by a tool): check the canonical encoding
        data = json.loads(line)
        body = json.dumps(data["record"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if hashlib.sha256(body.encode()).hexdigest()[:32] == data["sha256"]:
            return _record(data["record"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def read(path: Path) -> tuple[list[dict], int]:
    """The records of a log and the length of its valid prefix in bytes. A torn tail (an unterminated or
    bad last record, nothing valid after it) is left out; a bad record with valid ones after it raises."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    lines = data.split(b"\n")
    if lines[-1]:
        lines[-1] = None  # the last append never got its newline: torn
    else:
        lines.pop()
    # records as written are checked by their digests, then parsed in one call (a resume replays many)
    bodies = [_verified_body(line) if line is not None else None for line in lines]
    good = 0
    while good < len(bodies) and bodies[good] is not None:
        good += 1
    try:
        records = [_record(r) for r in json.loads(b"[" + b",".join(bodies[:good]) + b"]")]
    except ValueError:
        records = [None] * good
    records += [None] * (len(lines) - good)
    pos = 0
    out = []
    for i, line in enumerate(lines):
        if line is None:
            break
        record = records[i] if records[i] is not None else _decode(line)
        if record is None:
            if any(_decode(rest) for rest in lines[i + 1:] if rest is not None and rest.strip()):
                raise LogError(f"{path}: record {len(out) + 1} is damaged and valid records follow it; the "
                               "folder was edited or the disk damaged it")
            break
        out.append(record)
        pos += len(line) + 1
    return out, pos


class CommitLog:
    """The writer's end: appends records durably, after cutting off a torn tail once."""

    def __init__(self, out_dir: Path, valid_bytes: int | None = None) -> None:
        """`valid_bytes`: the length of the log's valid prefix when the caller has just read it."""
        self.path = out_dir / LOG
        good = read(self.path)[1] if valid_bytes is None else valid_bytes
        if self.path.exists() and self.path.stat().st_size != good:
            # a crash cut the last append short: cut it off before appending. Not fsynced here: until the next
            # append's fsync (which makes the new size durable too) a crash leaves the torn tail, read as torn again
            with File(disk(), self.path, truncate=False) as f:
                f.truncate(good)
        self.bytes = good

    def append(self, record: dict) -> None:
        """The record, durable when this returns. On a failure (a write or the fsync) the append is cut
        off again where it can be and the error raised: the caller stops committing, since after a failed
        fsync the file's unsynced pages may be gone whatever a later fsync says."""
        line = encode(record)
        layer = disk()
        new = not self.path.exists()
        with File(layer, self.path, append=True) as f:
            try:
                f.write(line)
                f.sync()
            except BaseException:
                try:
                    f.truncate(self.bytes)  # nothing half-written stays (best effort: a full disk can refuse)
                except OSError:
                    pass
                raise
        if new:
            layer.fsync_dir(self.path.parent)  # the log's name: without it the first records can vanish
        self.bytes += len(line)
