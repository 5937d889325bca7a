"""Append-only, fsync'd log of committed tables and acceptor state.

Records are framed `<u32 length><u32 crc32><u8 kind><payload>` (little-endian; the crc covers kind and
payload). Every append is written and fsync'd before it returns, so a reply or a send that follows it
never outruns the disk. Recovery reads records in order and stops at the first short or corrupt one: that
is the tail a `kill -9` tore mid-write, never a record that was acknowledged. The torn tail is truncated
so that later appends follow the last whole record.

The bytes live on a `Disk`: `FileDisk` (a real file, write + fsync) or `MemoryDisk` (the simulator's
disk, which survives a simulated crash just as the file survives `kill -9`). The framing and the
recovery code are the same for both.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from elasticmoe.v1 import consensus_pb2 as pb

_HEADER = struct.Struct("<IIB")
KIND_COMMIT = 1
KIND_ACCEPTOR = 2
MAX_RECORD = 256 << 20  # a length beyond this is a torn header, not a record


class StoreError(RuntimeError):
    """The store cannot be used (closed, or not opened)."""


class Disk(Protocol):
    def read_all(self) -> bytes: ...
    def append(self, data: bytes) -> None:
        """Write `data` at the end and make it durable before returning."""
        ...
    def truncate(self, size: int) -> None: ...
    def replace(self, data: bytes) -> None:
        """Atomically make `data` the whole content, durably (compaction)."""
        ...
    def close(self) -> None: ...


class FileDisk:
    """A file opened for append; every append is write + fsync."""

    def __init__(self, path: str | Path, sync: bool = True) -> None:
        self.path = Path(path)
        self.sync = sync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if created and sync:  # make the new directory entry durable too
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

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
        tmp = self.path.with_name(self.path.name + ".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self.sync:
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self.close()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MemoryDisk:
    """The simulator's disk: bytes that outlive the node object, as a file outlives `kill -9`."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.appends = 0

    def read_all(self) -> bytes:
        return bytes(self.data)

    def append(self, data: bytes) -> None:
        self.data += data
        self.appends += 1

    def truncate(self, size: int) -> None:
        del self.data[size:]

    def replace(self, data: bytes) -> None:
        self.data = bytearray(data)

    def tear(self, garbage: bytes) -> None:
        """Simulate a write torn by a crash: a partial record left at the end."""
        self.data += garbage

    def close(self) -> None:
        pass


def frame(kind: int, payload: bytes) -> bytes:
    body = bytes([kind]) + payload
    return _HEADER.pack(len(payload), zlib.crc32(body), kind) + payload


@dataclass
class Recovered:
    """What `Store.open` found: committed tables in log order and the last acceptor state per version."""

    commits: list[pb.Commit] = field(default_factory=list)
    acceptor: dict[int, pb.AcceptorState] = field(default_factory=dict)
    records: int = 0
    torn_bytes: int = 0


def parse(data: bytes) -> tuple[Recovered, int]:
    """Decode whole records from `data`; returns what they hold and the offset just after the last one."""
    rec = Recovered()
    off = 0
    while off + _HEADER.size <= len(data):
        length, crc, kind = _HEADER.unpack_from(data, off)
        end = off + _HEADER.size + length
        if length > MAX_RECORD or end > len(data):
            break
        payload = data[off + _HEADER.size:end]
        if zlib.crc32(bytes([kind]) + payload) != crc:
            break
        try:
            if kind == KIND_COMMIT:
                rec.commits.append(pb.Commit.FromString(payload))
            elif kind == KIND_ACCEPTOR:
                st = pb.AcceptorState.FromString(payload)
                rec.acceptor[st.version] = st
            else:
                break
        except DecodeError:
            break
        rec.records += 1
        off = end
    rec.torn_bytes = len(data) - off
    return rec, off


class Store:
    """The node's durable consensus state. `open()` recovers; every `save_*`/`append_*` is durable on return."""

    def __init__(self, path: str | Path | None = None, *, disk: Disk | None = None, sync: bool = True) -> None:
        if (path is None) == (disk is None):
            raise StoreError("Store needs exactly one of path= or disk=")
        self._disk: Disk = disk if disk is not None else FileDisk(path, sync=sync)  # type: ignore[arg-type]
        self._opened = False
        self.appends = 0
        self.size = 0  # bytes in the log: what compaction watches

    def open(self) -> Recovered:
        """Read the log, truncate a torn tail, and return the committed tables and acceptor state."""
        data = self._disk.read_all()
        rec, end = parse(data)
        if end < len(data):
            self._disk.truncate(end)
        self._opened = True
        self.size = end
        return rec

    recover = open

    def _append(self, data: bytes) -> None:
        if not self._opened:
            raise StoreError("store not opened: call open() (recovery) before writing")
        self._disk.append(data)
        self.appends += 1
        self.size += len(data)

    def append_commit(self, commit: pb.Commit, also: list[pb.AcceptorState] | None = None) -> None:
        """Append a commit, and any acceptor states riding along, with one write and one fsync."""
        data = frame(KIND_COMMIT, commit.SerializeToString())
        for st in also or ():
            data += frame(KIND_ACCEPTOR, st.SerializeToString())
        self._append(data)

    def save_acceptor(self, state: pb.AcceptorState) -> None:
        self._append(frame(KIND_ACCEPTOR, state.SerializeToString()))

    def compact(self, commits: list[pb.Commit], acceptor: list[pb.AcceptorState]) -> None:
        """Replace the log by just these records (the commits still to keep, in order, and the acceptor state
        of undecided versions), atomically: a crash leaves either the old log or the new one."""
        if not self._opened:
            raise StoreError("store not opened: call open() (recovery) before compacting")
        data = b"".join([frame(KIND_COMMIT, c.SerializeToString()) for c in commits]
                        + [frame(KIND_ACCEPTOR, st.SerializeToString()) for st in acceptor])
        self._disk.replace(data)
        self.size = len(data)

    def close(self) -> None:
        self._disk.close()
        self._opened = False
