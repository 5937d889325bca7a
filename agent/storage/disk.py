"""Where the consensus log's bytes live (agent.storage.store frames and recovers them): `FileDisk`, a real file with
write + fsync, and `MemoryDisk`, the simulator's disk, which outlives a simulated crash as a file outlives
`kill -9`; and the durable-write helpers the data_dir uses."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Protocol


class Disk(Protocol):
    where: str

    def read_all(self) -> bytes: ...
    def append(self, data: bytes) -> None:
        """Write `data` at the end and make it durable before returning."""
        ...
    def truncate(self, size: int) -> None: ...
    def replace(self, data: bytes) -> None:
        """Atomically make `data` the whole content, durably (compaction)."""
        ...
    def probe(self, nbytes: int) -> None:
        """Raise OSError unless `nbytes` can be written and made durable beside the log (the disk recovered)."""
        ...
    def read_mark(self) -> bytes | None:
        """The high-water mark kept beside the log (None: there is none)."""
        ...
    def write_mark(self, data: bytes, sync: bool) -> None:
        """Overwrite the mark; `sync`: durably before returning (else as the OS gets to it)."""
        ...
    def close(self) -> None: ...


def fsync_dir(d: Path) -> None:
    """Make the directory entries of `d` durable (a new or renamed file in it)."""
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_atomic(path: Path, data: bytes, tmp_suffix: str = ".tmp", sync: bool = True) -> None:
    """Write `data` to a file beside `path`, fsync it, rename it over `path`, fsync the directory: a crash
    leaves the old file or the new one, never a mix. On a write error the old file is untouched."""
    tmp = path.with_name(path.name + tmp_suffix)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def mark_path(log: Path) -> Path:
    """Where the high-water mark of the log at `log` lives (agent.storage.store)."""
    return log.with_name(log.name + ".mark")


class FileDisk:
    """A file opened for append; every append is write + fsync."""

    def __init__(self, path: str | Path, sync: bool = True) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        self.sync = sync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if created and sync:  # make the new directory entry durable too
            fsync_dir(self.path.parent)
        self.mark_path = mark_path(self.path)
        self._mark_fd = -1

    def read_mark(self) -> bytes | None:
        try:
            return self.mark_path.read_bytes()
        except FileNotFoundError:
            return None

    def write_mark(self, data: bytes, sync: bool) -> None:
        if self._mark_fd < 0:
            created = not self.mark_path.exists()
            self._mark_fd = os.open(self.mark_path, os.O_RDWR | os.O_CREAT, 0o644)
            sync = sync or created
            if created and self.sync:
                fsync_dir(self.path.parent)
        os.pwrite(self._mark_fd, data, 0)  # one small write in place: whole or not at all in practice
        if sync and self.sync:
            os.fsync(self._mark_fd)

    def read_all(self) -> bytes:
        return self.path.read_bytes()

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.sync:
            os.fsync(self._fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)
        if self.sync:
            os.fsync(self._fd)

    def replace(self, data: bytes) -> None:
        """Write a new file beside the old one, fsync it, rename it over the old one, fsync the directory."""
        write_atomic(self.path, data, ".compact", self.sync)  # the old log is untouched if this fails
        self.close()  # from here on, appends go to the new file
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)

    def probe(self, nbytes: int) -> None:
        tmp = self.path.with_name(self.path.name + ".probe")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(bytes(nbytes))
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            tmp.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._mark_fd >= 0:
            os.close(self._mark_fd)
            self._mark_fd = -1


class MemoryDisk:
    """The simulator's disk: bytes that outlive the node object, as a file outlives `kill -9`."""

    def __init__(self) -> None:
        self.where = "memory disk"
        self.data = bytearray()
        self.appends = 0
        self.capacity: int | None = None  # bytes the disk holds; a write past it is cut short with ENOSPC
        self.mark: bytes | None = None

    def read_mark(self) -> bytes | None:
        return self.mark

    def write_mark(self, data: bytes, sync: bool) -> None:
        self.mark = data

    def read_all(self) -> bytes:
        return bytes(self.data)

    def append(self, data: bytes) -> None:
        if self.capacity is not None and len(self.data) + len(data) > self.capacity:
            self.data += data[:max(0, self.capacity - len(self.data))]  # a short write, as a full disk gives
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.data += data
        self.appends += 1

    def probe(self, nbytes: int) -> None:
        if self.capacity is not None and len(self.data) + nbytes > self.capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def truncate(self, size: int) -> None:
        del self.data[size:]

    def replace(self, data: bytes) -> None:
        self.data = bytearray(data)

    def tear(self, garbage: bytes) -> None:
        """Simulate a write torn by a crash: a partial record left at the end."""
        self.data += garbage

    def close(self) -> None:
        pass
