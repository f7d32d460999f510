"""Disk layers for the durability tests: RecordingDisk logs every persisted operation of a job under a root
folder (with the bytes written) while doing it for real; FaultyDisk raises an OSError at one chosen
operation. Both stand in for batchjob.io.disk.Disk through `using()`: the job's code is the production code.
"""
from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from batchjob.io.disk import Disk

# operation kinds: names (the folder's entries) and data (a file's bytes), and what syncs them
NAME_OPS = ("create", "rename", "link", "unlink", "mkdir")
DATA_OPS = ("write", "trunc")


@dataclass(slots=True)
class Op:
    kind: str  # create write trunc fsync rename link unlink mkdir fsync_dir ack
    path: str = ""  # relative to the root (create, rename's source, link's source, unlink, mkdir, fsync_dir)
    to: str = ""  # rename's and link's target
    inode: int = -1  # write, trunc, fsync, create
    offset: int = 0
    data: bytes = b""  # write: the bytes; trunc: nothing (size in offset)
    site: str = ""  # what called the sync: fsync and fsync_dir, for the mutation test
    ack: object = None  # ack: what the job acknowledged as durable at this point


@dataclass
class Recording:
    initial: dict[str, bytes | None]  # the root's files (bytes) and folders (None) when recording began: durable
    ops: list[Op] = field(default_factory=list)
    skipped: list[tuple[int, Op]] = field(default_factory=list)  # a mutant's syncs not done: (where in ops, the sync)

    def unsynced_prefixes(self) -> set[int]:
        """The prefixes at which a skipped sync can matter: from where it was skipped until the next sync of the same
        file or folder (that sync makes durable everything the skipped one would have). A crash state outside them is
        one the unmutated recording has too (the crash-state test checks those)."""
        prefixes: set[int] = set()
        for at, sync in self.skipped:
            heal = next((j for j in range(at, len(self.ops)) if self.ops[j].kind == sync.kind
                         and (self.ops[j].inode, self.ops[j].path) == (sync.inode, sync.path)), len(self.ops))
            prefixes.update(range(at + 1, heal + 1))  # the ops after the skipped sync, up to the healing one
        return prefixes


def caller_site() -> str:
    """Who asked for a sync, to name a mutant without it: the first two batchjob functions on the stack outside
    the layer, innermost first (`io.manifest.atomic_write<io.manifest.commit`)."""
    import sys

    names = []
    frame = sys._getframe(2)
    while frame is not None and len(names) < 2:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("batchjob.") and module != "batchjob.io.disk":
            names.append(f"{module.removeprefix('batchjob.')}.{frame.f_code.co_name}")
        frame = frame.f_back
    return "<".join(names) or "?"


class RecordingDisk(Disk):
    """Records operations under `root`; `skip_sites`: syncs asked for from these sites (`fsync:SITE`,
    `fsync_dir:SITE`, as caller_site names them) are not done and not recorded: a mutant of the protocol
    without that sync."""

    def __init__(self, root: Path, skip_sites: frozenset[str] = frozenset()) -> None:
        self.root = Path(root).resolve()
        self.skip_sites = skip_sites
        self.lock = threading.RLock()
        self.fds: dict[int, tuple[int, bool]] = {}  # fd -> (inode, append)
        self.paths: dict[int, str] = {}  # fd -> the path it was opened as (every fd, under the root or not)
        self.names: dict[str, int] = {}  # the live name -> inode map, to find what a path holds
        self.next_inode = 0
        self.recording = Recording(self._scan())

    def _scan(self) -> dict[str, bytes | None]:
        found: dict[str, bytes | None] = {}
        for folder, dirs, files in os.walk(self.root):
            for d in dirs:
                found[self._rel(Path(folder) / d)] = None
            for f in files:
                path = Path(folder) / f
                rel = self._rel(path)
                found[rel] = path.read_bytes()
                self.names[rel] = self._new_inode()
        return found

    def _new_inode(self) -> int:
        self.next_inode += 1
        return self.next_inode

    def _rel(self, path) -> str | None:
        path = Path(os.path.abspath(path))
        try:
            rel = str(path.relative_to(self.root))
        except ValueError:
            return None
        return "" if rel == "." else rel  # the root folder is "" in the crash model

    def _add(self, op: Op) -> None:
        self.recording.ops.append(op)

    def ack(self, what) -> None:
        """The job acknowledged `what` as durable (a commit, an export) at this point."""
        with self.lock:
            self._add(Op("ack", ack=what))

    # primitives

    def open(self, path, *, append=False, truncate=True) -> int:
        with self.lock:
            rel = self._rel(path)
            existed = os.path.exists(path)
            fd = super().open(path, append=append, truncate=truncate)
            self.paths[fd] = str(path)
            if rel is not None:
                if not existed:
                    inode = self._new_inode()
                    self.names[rel] = inode
                    self._add(Op("create", path=rel, inode=inode))
                else:
                    inode = self.names[rel]
                    if truncate and not append:
                        self._add(Op("trunc", inode=inode, offset=0))
                self.fds[fd] = (inode, append)
            return fd

    def write(self, fd, data, offset=None) -> None:
        with self.lock:
            known = self.fds.get(fd)
            if known is not None:
                inode, append = known
                at = offset if offset is not None else (os.fstat(fd).st_size if append else os.lseek(fd, 0, os.SEEK_CUR))
            super().write(fd, data, offset)
            if known is not None:
                self._add(Op("write", inode=inode, offset=at, data=bytes(data)))

    def fsync(self, fd) -> None:
        site = "fsync:" + caller_site()
        if site in self.skip_sites:
            with self.lock:
                if fd in self.fds:
                    self.recording.skipped.append((len(self.recording.ops), Op("fsync", inode=self.fds[fd][0], site=site)))
            return
        with self.lock:
            super().fsync(fd)
            if fd in self.fds:
                self._add(Op("fsync", inode=self.fds[fd][0], site=site))

    def ftruncate(self, fd, size) -> None:
        with self.lock:
            super().ftruncate(fd, size)
            if fd in self.fds:
                self._add(Op("trunc", inode=self.fds[fd][0], offset=size))

    def close(self, fd) -> None:
        with self.lock:
            self.fds.pop(fd, None)
            self.paths.pop(fd, None)
            super().close(fd)

    def rename(self, src, dst) -> None:
        with self.lock:
            super().rename(src, dst)
            a, b = self._rel(src), self._rel(dst)
            if a is not None:
                self.names[b] = self.names.pop(a)
                self._add(Op("rename", path=a, to=b))

    def link(self, src, dst) -> None:
        with self.lock:
            super().link(src, dst)
            a, b = self._rel(src), self._rel(dst)
            if a is not None:
                self.names[b] = self.names[a]
                self._add(Op("link", path=a, to=b))

    def unlink(self, path) -> None:
        with self.lock:
            super().unlink(path)
            rel = self._rel(path)
            if rel is not None:
                self.names.pop(rel, None)
                self._add(Op("unlink", path=rel))

    def make_dir(self, path) -> None:
        with self.lock:
            super().make_dir(path)
            rel = self._rel(path)
            if rel is not None:
                self._add(Op("mkdir", path=rel))

    def fsync_dir(self, path) -> None:
        site = "fsync_dir:" + caller_site()
        if site in self.skip_sites:
            with self.lock:
                rel = self._rel(path)
                if rel is not None:
                    self.recording.skipped.append((len(self.recording.ops), Op("fsync_dir", path=rel, site=site)))
            return
        with self.lock:
            super().fsync_dir(path)
            rel = self._rel(path)
            if rel is not None:
                self._add(Op("fsync_dir", path=rel, site=site))


class FaultyDisk(RecordingDisk):
    """A RecordingDisk whose operation number `at` (counting the primitives that persist something: open,
    write, fsync, ftruncate, rename, link, unlink, make_dir, fsync_dir) fails with `errno_`. A write that
    fails with ENOSPC first writes half its bytes (a short write, then the error)."""

    KINDS = ("open", "write", "fsync", "ftruncate", "rename", "link", "unlink", "make_dir", "fsync_dir")

    def __init__(self, root: Path, at: int, errno_: int) -> None:
        super().__init__(root)
        self.at, self.errno_ = at, errno_
        self.count = 0
        self.kinds: list[str] = []  # each operation's kind, in order
        self.failed: str | None = None  # the operation that failed, once it did

    def _maybe_fail(self, kind: str, target) -> None:
        with self.lock:
            self.count += 1
            self.kinds.append(kind)
            if self.count == self.at:
                target = self.paths.get(target, target) if isinstance(target, int) else target
                self.failed = f"{kind} {target}"
                raise OSError(self.errno_, os.strerror(self.errno_), str(target))

    def open(self, path, *, append=False, truncate=True) -> int:
        self._maybe_fail("open", path)
        return super().open(path, append=append, truncate=truncate)

    def write(self, fd, data, offset=None) -> None:
        with self.lock:
            if self.count + 1 == self.at and self.errno_ == errno.ENOSPC and len(data) > 1:
                super().write(fd, data[:len(data) // 2], offset)  # a short write, then the disk is full
            self._maybe_fail("write", fd)
            super().write(fd, data, offset)

    def fsync(self, fd) -> None:
        self._maybe_fail("fsync", fd)
        super().fsync(fd)

    def ftruncate(self, fd, size) -> None:
        self._maybe_fail("ftruncate", fd)
        super().ftruncate(fd, size)

    def rename(self, src, dst) -> None:
        self._maybe_fail("rename", dst)
        super().rename(src, dst)

    def link(self, src, dst) -> None:
        self._maybe_fail("link", dst)
        super().link(src, dst)

    def unlink(self, path) -> None:
        self._maybe_fail("unlink", path)
        super().unlink(path)

    def make_dir(self, path) -> None:
        self._maybe_fail("make_dir", path)
        super().make_dir(path)

    def fsync_dir(self, path) -> None:
        self._maybe_fail("fsync_dir", path)
        super().fsync_dir(path)
