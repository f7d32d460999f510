"""Disk: the one narrow layer through which every byte a job persists goes (parts, the commit log and
manifest snapshots, the lock, stats, job.json, exports, OpenAI Batch response files).

The primitives (open, write, fsync, ftruncate, close, rename, link, unlink, make_dir and the folder's
fsync) and the two compositions built on them: `write_atomic` (a temp file, written, fsynced,
renamed over the target, the folder fsynced) and `File` (an open file written through the layer).
Nothing else in the package writes a file that a job commits (tests/io/test_disk_layer.py checks).

Why one layer: the crash simulator of the test suite (tests/durability/) records a job's operations
here and builds the on-disk state a power cut would leave after each of them; a fault injector raises
EIO, ENOSPC or EROFS at any one of them. Both replace the layer with `using()`; the job's code is the same.

Errors are never swallowed: a failed fsync means the data may be lost (the kernel can drop the dirty
pages and report success on the next fsync: "Can Applications Recover from fsync Failures?", USENIX
ATC '20), so every caller treats it as the write having failed and nothing is acknowledged after it.
The one exception is a folder fsync that the file system does not support (EINVAL, EOPNOTSUPP): there
is nothing to sync, and nothing can be done better.
"""
from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP)


class Disk:
    """The real file system. Subclasses (the recorder, the fault injector) override the primitives."""

    # primitives

    def open(self, path: Path, *, append: bool = False, truncate: bool = True) -> int:
        """A file opened for writing, created when missing: emptied (`truncate`), or written at its end
        (`append`), or neither (the lock, a log cut back by ftruncate)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        if append:
            flags |= os.O_APPEND
        elif truncate:
            flags |= os.O_TRUNC
        return os.open(path, flags, 0o644)

    def write(self, fd: int, data: bytes, offset: int | None = None) -> None:
        """All of `data`, at the file's position (or at `offset`); a short write continues, an error raises."""
        view = memoryview(data)
        while view:
            n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
            if offset is not None:
                offset += n
            view = view[n:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def fsync_dir(self, path: Path) -> None:
        """Makes the names created, renamed or removed in `path` durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
        finally:
            os.close(fd)

    def mkdir(self, path: Path) -> None:
        """`path` and its missing parents, each new one durable (its parent fsynced): a folder whose
        name was never synced can vanish with every file in it."""
        path = Path(path)
        missing = []
        while not path.is_dir():
            missing.append(path)
            if path.parent == path:
                break
            path = path.parent
        for folder in reversed(missing):
            try:
                self.make_dir(folder)
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue  # made by another process meanwhile: it syncs its parent
            self.fsync_dir(folder.parent)

    def make_dir(self, path: Path) -> None:
        os.mkdir(path)

    # compositions

    def write_atomic(self, path: Path, data: bytes | Iterable[bytes]) -> int:
        """`data` under `path`, all or nothing: written to `.NAME.tmp` beside it, fsynced, renamed over
        `path`, then the folder fsynced. A failure leaves `path` as it was and no temp file. Returns the
        bytes written."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        size = 0
        try:
            with File(self, tmp) as f:
                for chunk in ([data] if isinstance(data, (bytes, bytearray, memoryview)) else data):
                    f.write(chunk)
                    size += len(chunk)
                f.sync()
            self.rename(tmp, path)
        except BaseException:
            self.discard(tmp)
            raise
        self.fsync_dir(path.parent)
        return size

    def remove(self, path: Path) -> None:
        """Unlink `path` when it is there."""
        try:
            self.unlink(path)
        except FileNotFoundError:
            pass

    def discard(self, path: Path) -> None:
        """Remove a temp file after a failure, if it is there; a second error would hide the first."""
        try:
            self.unlink(path)
        except OSError:
            pass


class File:
    """A file open for writing through a Disk, file-like enough for pyarrow's writers (io/merge.py hands it
    to them behind a guard). `sync()` is its fsync; an error from any call raises."""

    def __init__(self, disk: Disk, path: Path, *, append: bool = False, truncate: bool = True) -> None:
        self.disk, self.path = disk, Path(path)
        self.fd: int | None = disk.open(self.path, append=append, truncate=truncate)
        self.position = 0 if not append else os.fstat(self.fd).st_size

    # what pyarrow's Python-file wrapper calls
    closed = property(lambda self: self.fd is None)
    mode = "wb"

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.position

    def write(self, data) -> int:
        data = data.encode() if isinstance(data, str) else bytes(data)
        self.disk.write(self._fd(), data)
        self.position += len(data)
        return len(data)

    def pwrite(self, data: bytes, offset: int) -> None:
        self.disk.write(self._fd(), data, offset)

    def flush(self) -> None:
        pass  # nothing is buffered here

    def sync(self) -> None:
        self.disk.fsync(self._fd())

    def truncate(self, size: int) -> None:
        self.disk.ftruncate(self._fd(), size)
        self.position = min(self.position, size)

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            self.disk.close(fd)

    def _fd(self) -> int:
        if self.fd is None:
            raise ValueError(f"{self.path} is closed")
        return self.fd

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_current = Disk()
_swap = threading.Lock()


def disk() -> Disk:
    """The layer in use: the real file system, or what a test installed with `using()`."""
    return _current


@contextmanager
def using(layer: Disk) -> Iterator[Disk]:
    """Every persisted write goes through `layer` inside this block (a crash recorder, a fault injector)."""
    global _current
    with _swap:
        previous, _current = _current, layer
    try:
        yield layer
    finally:
        with _swap:
            _current = previous
