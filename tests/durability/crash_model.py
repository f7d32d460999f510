"""Crash states: what a power cut after any prefix of a recorded job's operations can leave on disk.

The rules (the guarantees POSIX and Linux file systems give, nothing more):
- A file's bytes are durable once the file is fsynced. Writes since its last fsync may each be lost, kept, or
  torn at a 512- or 4096-byte sector boundary (the rest of the write missing, or the file's size kept with
  zeros where the data never arrived); a later write may survive an earlier one (reordering between syncs).
- A folder's entries (files created, renamed, linked, unlinked, folders made) are durable once the folder
  is fsynced. Entries changed since may survive in the order they were made (journaled metadata), any one
  rename may be lost on its own, and all of them may be lost.
- A file whose name did not survive is gone, whatever was synced of its bytes.

`crash_states(recording)` yields each distinct state once, with the prefix it came from and the rule that
made it; `materialize(state, folder)` writes it out as real files for a real rerun.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.durability.recorder import DATA_OPS, NAME_OPS, Op, Recording

SECTORS = (512, 4096)
FOLDER = None  # a name that holds a folder, not a file


@dataclass
class _File:
    durable: bytes = b""
    volatile: bytearray = field(default_factory=bytearray)
    pending: list[Op] = field(default_factory=list)  # data ops since its last fsync


@dataclass
class _Folder:
    durable: dict[str, object] = field(default_factory=dict)  # name -> inode (int) or FOLDER
    volatile: dict[str, object] = field(default_factory=dict)
    pending: list[Op] = field(default_factory=list)  # name ops since its last fsync


@dataclass(frozen=True)
class CrashState:
    prefix: int  # how many operations ran before the power went
    rule: str  # which choice among the unsynced operations made it
    files: tuple[tuple[str, bytes | None], ...]  # (path, bytes) of every file, (path, None) of every folder
    links: tuple[tuple[str, str], ...]  # (path, the path it is a hard link of)
    acks: tuple  # what the job had acknowledged as durable before the power went

    def key(self) -> str:
        h = hashlib.sha256()
        for path, data in self.files:
            h.update(path.encode() + b"\0" + (b"D" if data is None else hashlib.sha256(data).digest()))
        for a, b in self.links:
            h.update(f"{a}->{b}".encode())
        h.update(f"acks {len(self.acks)}".encode())  # the same disk after another acknowledgement: checked again
        return h.hexdigest()


def _parent(path: str) -> str:
    return os.path.dirname(path)


def _apply_data(content: bytearray, op: Op, cut: int | None = None, zeros: bool = False) -> None:
    if op.kind == "trunc":
        del content[op.offset:]
        content.extend(b"\0" * (op.offset - len(content)))
        return
    data = op.data if cut is None else op.data[:cut] + (b"\0" * (len(op.data) - cut) if zeros else b"")
    end = op.offset + len(data)
    if len(content) < op.offset:
        content.extend(b"\0" * (op.offset - len(content)))
    content[op.offset:end] = data


def _apply_name(names_of, op: Op) -> None:
    """One name op on the name maps (`names_of(folder)` gives a folder's dict); skipped where its source is
    gone (the op that made it was lost)."""
    if op.kind in ("create", "mkdir"):
        names_of(_parent(op.path))[os.path.basename(op.path)] = op.inode if op.kind == "create" else FOLDER
    elif op.kind in ("rename", "link"):
        src = names_of(_parent(op.path))
        name = os.path.basename(op.path)
        if name not in src:
            return
        node = src[name] if op.kind == "link" else src.pop(name)
        names_of(_parent(op.to))[os.path.basename(op.to)] = node
    elif op.kind == "unlink":
        names_of(_parent(op.path)).pop(os.path.basename(op.path), None)


class Model:
    """The volatile and durable state while replaying operations."""

    def __init__(self, recording: Recording) -> None:
        self.files: dict[int, _File] = {}
        self.folders: dict[str, _Folder] = {"": _Folder()}
        self.acks: list = []
        number = 0  # RecordingDisk._scan numbers the files in this (os.walk) order, which `initial` keeps
        for path, data in recording.initial.items():
            parent = self.folder(_parent(path))
            if data is None:
                parent.durable[os.path.basename(path)] = parent.volatile[os.path.basename(path)] = FOLDER
                self.folder(path)
                continue
            number += 1
            parent.durable[os.path.basename(path)] = parent.volatile[os.path.basename(path)] = number
            self.files[number] = _File(durable=data, volatile=bytearray(data))

    def folder(self, path: str) -> _Folder:
        return self.folders.setdefault(path, _Folder())

    def apply(self, op: Op) -> None:
        if op.kind == "ack":
            self.acks.append(op.ack)
        elif op.kind in DATA_OPS:
            f = self.files[op.inode]
            _apply_data(f.volatile, op)
            f.pending.append(op)
        elif op.kind == "fsync":
            f = self.files[op.inode]
            f.durable, f.pending = bytes(f.volatile), []
        elif op.kind in NAME_OPS:
            if op.kind == "create":
                self.files[op.inode] = _File()
            if op.kind == "mkdir":
                self.folder(op.path)
            _apply_name(lambda p: self.folder(p).volatile, op)
            for path in {_parent(op.path), _parent(op.to) if op.to else _parent(op.path)}:
                self.folder(path).pending.append(op)
        elif op.kind == "fsync_dir":
            folder = self.folder(op.path)
            folder.durable, folder.pending = dict(folder.volatile), []

    # one crash state

    def state(self, prefix: int, rule: str, *, names: dict[str, list[bool]] | None = None,
              data: dict[int, list[bool]] | None = None, tear: tuple[int, int, bool] | None = None) -> CrashState:
        """The disk after a power cut now: of each folder's pending name ops those `names[folder]` keeps (all
        by default), of each file's pending data ops those `data[inode]` keeps (all by default); `tear`:
        (inode, sector, zeros) tears that file's last kept write at the sector boundary."""
        names = names or {}
        data = data or {}
        crashed: dict[str, dict] = {}
        for path, folder in self.folders.items():
            crashed[path] = dict(folder.durable)
        applied: set[int] = set()  # an op shared by two folders (a rename across them) is applied once
        for path, folder in self.folders.items():
            keep = names.get(path, [True] * len(folder.pending))
            for op, kept in zip(folder.pending, keep):
                if kept and id(op) not in applied:
                    applied.add(id(op))
                    _apply_name(lambda p: crashed.setdefault(p, {}), op)
        contents: dict[int, bytes] = {}
        for inode, f in self.files.items():
            content = bytearray(f.durable)
            keep = data.get(inode, [True] * len(f.pending))
            kept_ops = [op for op, k in zip(f.pending, keep) if k]
            for i, op in enumerate(kept_ops):
                if tear is not None and tear[0] == inode and i == len(kept_ops) - 1 and op.kind == "write":
                    cut = _cut(op, tear[1])
                    _apply_data(content, op, cut, tear[2])
                else:
                    _apply_data(content, op)
            contents[inode] = bytes(content)
        files: list[tuple[str, bytes | None]] = []
        links: list[tuple[str, str]] = []
        first: dict[int, str] = {}

        def walk(path: str) -> None:
            for name in sorted(crashed.get(path, {})):
                node = crashed[path][name]
                child = os.path.join(path, name) if path else name
                if node is FOLDER:
                    files.append((child, None))
                    walk(child)
                elif node in first:
                    links.append((child, first[node]))
                else:
                    first[node] = child
                    files.append((child, contents[node]))

        walk("")
        return CrashState(prefix, rule, tuple(files), tuple(links), tuple(self.acks))


def _cut(op: Op, sector: int) -> int:
    """How many of the write's bytes reach the disk when it is torn at the last `sector` boundary inside it."""
    end = op.offset + len(op.data)
    boundary = (end - 1) // sector * sector
    return max(0, boundary - op.offset)


def crash_states(recording: Recording, *, prefixes: Collection[int] | None = None) -> Iterator[CrashState]:
    """Each distinct crash state over the prefixes of the recording (every one by default)."""
    model = Model(recording)
    seen: set[str] = set()
    ops = recording.ops
    prefixes = range(len(ops) + 1) if prefixes is None else prefixes
    for k in range(len(ops) + 1):
        if k > 0:
            model.apply(ops[k - 1])
        if k not in prefixes:
            continue
        for state in _variants(model, k):
            key = state.key()
            if key not in seen:
                seen.add(key)
                yield state


def _variants(model: Model, k: int) -> Iterator[CrashState]:
    folders = {p: f.pending for p, f in model.folders.items() if f.pending}
    files = {i: f.pending for i, f in model.files.items() if f.pending}
    yield model.state(k, "all kept (as after a SIGKILL)")
    if not folders and not files:
        return
    yield model.state(k, "only the synced", names={p: [False] * len(o) for p, o in folders.items()},
                      data={i: [False] * len(o) for i, o in files.items()})
    if folders and files:
        yield model.state(k, "names kept, unsynced bytes lost", data={i: [False] * len(o) for i, o in files.items()})
        yield model.state(k, "bytes kept, unsynced names lost", names={p: [False] * len(o) for p, o in folders.items()})
    for path, ops in folders.items():
        for j in range(len(ops)):  # a prefix of the folder's changes survives, in order
            yield model.state(k, f"{path or '.'}: first {j} of {len(ops)} name changes",
                              names={path: [i < j for i in range(len(ops))]})
        for j, op in enumerate(ops):
            if op.kind == "rename" and len(ops) > 1:
                yield model.state(k, f"rename {op.path} -> {op.to} lost alone",
                                  names={path: [i != j for i in range(len(ops))]})
    for inode, ops in files.items():
        yield model.state(k, f"file {inode}: unsynced bytes lost", data={inode: [False] * len(ops)})
        writes = [i for i, op in enumerate(ops) if op.kind == "write"]
        if writes:
            for sector in SECTORS:
                for zeros in (False, True):
                    yield model.state(k, f"file {inode}: last write torn at {sector}{' (zeros)' if zeros else ''}",
                                      tear=(inode, sector, zeros))
        if len(ops) >= 2:
            yield model.state(k, f"file {inode}: only the last unsynced change kept",
                              data={inode: [i == len(ops) - 1 for i in range(len(ops))]})


def materialize(state: CrashState, folder: Path) -> None:
    """Write the state under `folder` (which must be empty or absent)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path, data in state.files:
        target = folder / path
        if data is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    for path, source in state.links:
        os.link(folder / source, folder / path)
