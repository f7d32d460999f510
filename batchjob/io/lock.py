"""OutputLock: one writer per output folder, held with flock on OUTPUT/.lock for the whole run.

The kernel drops the lock when its process dies, so a SIGKILL leaves nothing stale; the file itself
stays (deleting a lock file others may hold open would let two writers in). It holds the PID and
host of the holder, for the error message of a second writer and for `batchjob status`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from batchjob.io.disk import File, disk
from batchjob.io.recovery import SinkError

LOCK_NAME = ".lock"


class LockHeld(SinkError):
    """Another process holds the output folder."""


@dataclass(slots=True)
class Holder:
    held: bool
    pid: int | None = None
    host: str | None = None
    since: float | None = None  # epoch seconds


class OutputLock:
    def __init__(self, folder: str | Path, *, wait_s: float = 0.5) -> None:
        """Takes the lock or raises LockHeld naming the folder and the holder's PID; SinkError when the
        folder cannot be created or written. `wait_s` rides out a `status` call that peeks at the lock."""
        self.fd: int | None = None
        self.file: File | None = None
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        try:
            disk().mkdir(self.folder)
            file = File(disk(), self.path, truncate=False)  # never emptied on open: another holder's PID stays
            fd = file.fd
        except OSError as e:
            raise SinkError(f"cannot use output folder {self.folder}: {e.strerror or e} ({e.filename or self.path}); "
                            "choose a folder you can write to with --output") from e
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    file.close()
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder = _read_file(self.path)
                file.close()
                raise LockHeld(_in_use(self.folder, holder)) from None
        self.fd, self.file = fd, file
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        try:  # not fsynced: after a power cut no process holds the lock, whatever the file says
            file.truncate(0)
            file.pwrite(record + b"\n", 0)
        except OSError:
            pass  # a full disk must not stop us from holding the lock; the PID is only informative

    def release(self) -> None:
        if self.file is not None:
            try:
                self.file.truncate(0)  # a released lock names nobody
            except OSError:
                pass
            self.file.close()  # closing drops the flock
            self.file = self.fd = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_free(folder: str | Path) -> None:
    """LockHeld, as OutputLock says it, when another process holds `folder`: a run asks before it imports torch
    or loads a model (job/process/preflight.py), so a second run on a busy folder is refused in a second."""
    holder = lock_holder(folder)
    if holder.held:
        raise LockHeld(_in_use(Path(folder), holder))


def _in_use(folder: Path, holder: Holder) -> str:
    who = f"process {holder.pid}" + (f" on {holder.host}" if holder.host else "") if holder.pid else "another process"
    return (f"{folder} is in use by {who} (lock file {folder / LOCK_NAME}); wait for it to finish or stop it "
            f"(kill -TERM {holder.pid or 'PID'}), or use another output folder")


def lock_holder(folder: str | Path) -> Holder:
    """Whether a process holds `folder`'s lock (and which); takes the lock for an instant to find out."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return Holder(False)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read(fd)
                holder.held = True
                return holder
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return Holder(False)
    finally:
        os.close(fd)


def _read_file(path: Path) -> Holder:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return Holder(True)
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _read(fd: int) -> Holder:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return Holder(True, int(data["pid"]), data.get("host"), data.get("since"))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder(True)  # the holder has not written its PID yet
