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
import os
from pathlib import Path

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


def _decode(line: bytes) -> dict | None:
    body = line[_BODY_AT:-1]  # as encode() wrote it: the digest is over these very bytes
    if line.startswith(_HEAD) and line.endswith(b"}") and hashlib.sha256(body).hexdigest()[:32].encode() == line[len(_HEAD):len(_HEAD) + 32]:
        try:
            record = json.loads(body)
            if isinstance(record, dict) and isinstance(record.get("seq"), int):
                return record
        except ValueError:
            pass
    try:  # written some other way (re-encoded by a tool): check the canonical encoding
        data = json.loads(line)
        body = json.dumps(data["record"], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if hashlib.sha256(body.encode()).hexdigest()[:32] == data["sha256"] and isinstance(data["record"].get("seq"), int):
            return data["record"]
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
    records, pos = [], 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:  # the last append never got its newline: torn
            break
        record = _decode(data[pos:nl])
        if record is None:
            if any(_decode(line) for line in data[nl + 1:].split(b"\n") if line.strip()):
                raise LogError(f"{path}: record {len(records) + 1} is damaged and valid records follow it; the "
                               "folder was edited or the disk damaged it")
            break
        records.append(record)
        pos = nl + 1
    return records, pos


class CommitLog:
    """The writer's end: appends records durably, after cutting off a torn tail once."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOG
        _, good = read(self.path)
        if self.path.exists() and self.path.stat().st_size != good:
            with open(self.path, "r+b") as f:  # a crash cut the last append short: drop it before appending
                f.truncate(good)
                os.fsync(f.fileno())
        self.bytes = good

    def append(self, record: dict) -> None:
        line = encode(record)
        new = not self.path.exists()
        with open(self.path, "ab") as f:
            try:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.truncate(self.bytes)  # nothing half-written stays (best effort: a full disk can refuse)
                raise
        if new:
            fsync_dir(self.path.parent)
        self.bytes += len(line)


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in `path` durable; not possible on every platform or filesystem."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
