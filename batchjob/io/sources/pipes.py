"""An input that is a pipe or FIFO (`--input /dev/stdin`, `mkfifo`), read so that Ctrl-C reaches the read waiting on it.

CPython runs a signal's handler in the main thread, between bytecodes; the kernel may hand a signal sent to the process
to another thread (a native library's), and then a main thread asleep in read() on an empty FIFO never wakes to raise
KeyboardInterrupt: the job hangs (seen on a busy machine). A pipe here is opened without blocking and each read waits
in select() for at most WAIT_S, so a pending signal is seen within that. A regular file is opened as Python opens it."""
from __future__ import annotations

import os
import select
import stat
from pathlib import Path

WAIT_S = 0.2  # the longest a read waits before the main thread looks for a signal


def is_pipe(file: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(file).st_mode)
    except OSError:
        return False


def open_input(file: Path):
    """`file` for reading bytes: a pipe or FIFO as a PipeReader, anything else with open(file, "rb")."""
    return PipeReader(file) if is_pipe(file) else open(file, "rb")


class PipeReader:
    """A FIFO's bytes, read as a binary file (read, readinto, close, a context manager). Opened O_NONBLOCK, it does not
    wait for a writer to open; select() says readable once a writer wrote, or left (the end: read gives b"")."""

    def __init__(self, file: Path):
        self.name = str(file)
        self._fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts = []
            while chunk := self.read(1 << 20):
                parts.append(chunk)
            return b"".join(parts)
        while True:
            ready, _, _ = select.select([self._fd], [], [], WAIT_S)  # returns early for a signal's handler too
            if not ready:
                continue
            try:
                return os.read(self._fd, n)
            except BlockingIOError:  # readable, then taken: wait again
                continue

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self._fd)

    def __enter__(self) -> PipeReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
