"""Append-only, fsync'd log of committed tables and acceptor state (and of the voters that enrolled here
from an empty store, for agent/consensus/rebuild.py, and of the control-record state, agent/consensus/control.py).

Records are framed `<u32 length><u32 crc32><u8 kind><payload>` (little-endian; the crc covers kind and
payload). Every append is written and fsync'd before it returns, so a reply or a send that follows it
never outruns the disk.

Recovery reads records in order. A record that is cut short by the end of the file (or whose missing part
is all zeros) is the tail a `kill -9` tore mid-write: never acknowledged, so it is truncated (and logged)
and later appends follow the last whole record. Any other bad record is corruption of data that may have
been acknowledged: `open()` raises `StoreCorrupt` naming the offset and changes nothing on disk; the
operator's repair (`emoe store repair`) moves the log aside, and the node then rebuilds from its peers
as a learner (it does not vote until it has caught up).

A write that fails (ENOSPC, EIO) fail-stops the store: the partial record is cut off, every later write
raises `StoreFailed` until `resume()` finds the disk writable again, so nothing more is acknowledged
meanwhile. The consensus node stops voting while the store is failed and reports why.

A log cut at a record boundary (a file truncated or replaced by an older copy, a disk that dropped writes
it had acknowledged) parses cleanly, so the store also keeps a high-water mark beside the log: the log's
size after each append, written (without a second fsync: the log itself was fsync'd first, so the mark
never runs ahead of it) to `<log>.mark`. `open()` finds a log shorter than its mark, logs how many
acknowledged bytes are missing, and reports them in `Recovered.lost_bytes`; the consensus node then
rebuilds as a learner, as after a lost store (it may have voted on versions it no longer remembers). The
mark stays at its high until `settle_loss()` (the node has caught up past every version it may have voted
on), so a restart meanwhile is strict again. A missing mark (a log written before marks) checks nothing.

A log written by a newer release is refused, never misread nor truncated (elasticmoe/versions.py): a format
record (kind 255, `<u32 format>`) above this release's `STORE_FORMAT`, or a whole record (its crc checks) of a
kind this release does not know, stops `open()` with `StoreNewer` naming both, and nothing on disk changes. A
log of format 1 carries no format record; a store of a later format writes one before anything of its own.

The bytes live on a `Disk`: `FileDisk` (a real file, write + fsync) or `MemoryDisk` (the simulator's
disk, which survives a simulated crash just as the file survives `kill -9`). The framing and the
recovery code are the same for both.
"""

from __future__ import annotations

import logging
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError

from agent.storage.disk import Disk, FileDisk, MemoryDisk, fsync_dir, mark_path, write_atomic
from elasticmoe.v1 import consensus_pb2 as pb
from elasticmoe.versions import STORE_FORMAT

log = logging.getLogger(__name__)

__all__ = ["Disk", "FileDisk", "MemoryDisk", "Recovered", "Store", "StoreCorrupt", "StoreError", "StoreFailed",
           "StoreNewer", "corrupt_where", "frame", "fsync_dir", "high_water", "parse", "torn_tail",
           "write_atomic"]  # disks re-exported

_HEADER = struct.Struct("<IIB")
_MARK = struct.Struct("<4sQ")
_MARK_MAGIC = b"EMK1"
KIND_COMMIT = 1
KIND_ACCEPTOR = 2
KIND_KNOWN = 3  # the voters that enrolled here from an empty store (agent/consensus/rebuild.py): the whole map
KIND_REBUILD = 4  # this node's own rebuild: started (before any request) or done (before its first vote)
KIND_CONTROL = 5  # the control-record state (agent/consensus/control.py): the whole state, the last one wins
_KINDS = (KIND_COMMIT, KIND_ACCEPTOR, KIND_KNOWN, KIND_REBUILD, KIND_CONTROL)
MAX_RECORD = 256 << 20  # a length beyond this is a torn header, not a record
KIND_FORMAT = 255  # the format of the records after it (elasticmoe/versions.py): <u32 format>, then anything
_FORMAT = struct.Struct("<I")
_READ = (*_KINDS, KIND_FORMAT)  # the kinds this release reads


class StoreError(RuntimeError):
    """The store cannot be used (closed, or not opened)."""


class StoreCorrupt(StoreError):
    """A bad record that is not a torn tail (see `torn_tail`): data that may have been acknowledged is damaged.
    `context` says where it lies (`corrupt_where`). Nothing was changed on disk."""

    def __init__(self, where: str, offset: int, reason: str, size: int, context: str) -> None:
        self.where, self.offset, self.reason, self.size = where, offset, reason, size
        super().__init__(f"{where}: corrupt record at offset {offset} of {size} bytes ({reason}), {context}; "
                         f"refusing to start. The log is left as it is. To rebuild this node "
                         f"from its peers, stop it and run `emoe store repair --config <agent.toml>` (moves the "
                         f"log aside; the node rejoins as a learner and votes again once it has caught up)")


class StoreNewer(StoreError):
    """The log was written by a newer release (a format or a record kind this one does not know)."""

    def __init__(self, where: str, offset: int, what: str, readable: int) -> None:
        self.where, self.offset, self.what = where, offset, what
        super().__init__(f"{where}: {what} at offset {offset}: this log was written by a newer release than this "
                         f"agent, which reads store formats up to {readable}; refusing to start, the log is left as "
                         f"it is. Run the newer release on this data_dir, or, to go back to this one, rebuild the "
                         f"node from its peers: `emoe store repair --config <agent.toml>` moves the log aside")


class StoreFailed(StoreError):
    """A write failed (ENOSPC, EIO): the store is fail-stopped until `resume()` succeeds."""


def frame(kind: int, payload: bytes) -> bytes:
    body = bytes([kind]) + payload
    return _HEADER.pack(len(payload), zlib.crc32(body), kind) + payload


@dataclass
class Recovered:
    """What `Store.open` found: committed tables in log order and the last acceptor state per version."""

    commits: list[pb.Commit] = field(default_factory=list)
    acceptor: dict[int, pb.AcceptorState] = field(default_factory=dict)
    known: dict[str, int] = field(default_factory=dict)  # voter -> the first enrolment id it enrolled here with
    rebuild: pb.RebuildMark | None = None  # the last rebuild mark (None: this store never rebuilt)
    control: pb.ControlState | None = None  # the last control-record state (None: none was ever written)
    records: int = 0
    torn_bytes: int = 0
    lost_bytes: int = 0  # acknowledged bytes missing at the end (the log is shorter than its high-water mark)
    ends: list[int] = field(default_factory=list)  # where each whole record ends
    bad_offset: int = -1  # where the first bad record starts (-1: none)
    bad_reason: str = ""
    newer: str = ""  # the bad record is whole, of a newer release (a format or a kind this one does not know)
    format: int = 1  # the store format of the records read (the last format record's; 1 without one)


def _decode(kind: int, payload: bytes, rec: Recovered) -> str:
    """Add one record's content to `rec`; returns why it cannot be decoded, or ""."""
    try:
        if kind == KIND_FORMAT:
            if len(payload) < _FORMAT.size:
                return f"format record of {len(payload)} bytes: expected at least {_FORMAT.size}"
            rec.format = int(_FORMAT.unpack_from(payload)[0])
        elif kind == KIND_COMMIT:
            rec.commits.append(pb.Commit.FromString(payload))
        elif kind == KIND_ACCEPTOR:
            st = pb.AcceptorState.FromString(payload)
            rec.acceptor[st.version] = st
        elif kind == KIND_KNOWN:
            rec.known = dict(pb.KnownVoters.FromString(payload).enrolment)
        elif kind == KIND_REBUILD:
            rec.rebuild = pb.RebuildMark.FromString(payload)
        elif kind == KIND_CONTROL:
            rec.control = pb.ControlState.FromString(payload)
        else:
            return f"unknown record kind {kind}"
    except DecodeError as e:
        return f"kind {kind} payload does not decode: {e}"
    return ""


def _parse_mark(raw: bytes) -> int | None:
    """A high-water mark's value (None: not a mark)."""
    if len(raw) < _MARK.size or raw[:4] != _MARK_MAGIC:
        return None
    return int(_MARK.unpack_from(raw)[1])


def high_water(log_path: str | Path) -> int | None:
    """The high-water mark kept beside a log file (None: none, or unreadable)."""
    try:
        return _parse_mark(mark_path(Path(log_path)).read_bytes())
    except OSError:
        return None


def parse(data: bytes, readable: int = STORE_FORMAT) -> tuple[Recovered, int]:
    """Decode whole records from `data`; returns what they hold and the offset just after the last one
    (`rec.bad_offset` and `rec.bad_reason` say what stopped it, if anything did before the end; `rec.newer`
    that it is a record of a newer release than one that reads store formats up to `readable`)."""
    rec = Recovered()
    off = 0
    while off < len(data):
        why = ""
        if off + _HEADER.size > len(data):
            why = f"header cut short: {len(data) - off} of {_HEADER.size} bytes"
        else:
            length, crc, kind = _HEADER.unpack_from(data, off)
            end = off + _HEADER.size + length
            payload = data[off + _HEADER.size:end]
            if length > MAX_RECORD:
                why = f"length {length} exceeds {MAX_RECORD}"
            elif end > len(data):
                why = f"record cut short: {len(data) - off} of {end - off} bytes"
            elif zlib.crc32(bytes([kind]) + payload) != crc:
                why = "crc mismatch"
            elif kind not in _READ:
                why = rec.newer = f"a record of kind {kind}, which store format {readable} does not have"
            else:
                why = _decode(kind, payload, rec)  # adds nothing when it fails
                if not why and rec.format > readable:
                    why = rec.newer = f"a record of store format {rec.format}"
        if why:
            rec.bad_offset, rec.bad_reason = off, why
            break
        rec.records += 1
        off = end
        rec.ends.append(end)
    rec.torn_bytes = len(data) - off
    return rec, off


def _whole_record_after(data: bytes, start: int) -> int:
    """The offset of the first whole, decodable record that starts after `start`, or -1. Used only when
    recovery stopped early, to tell a torn tail (nothing whole after it) from corruption in the middle."""
    for off in range(start + 1, len(data) - _HEADER.size + 1):
        length, crc, kind = _HEADER.unpack_from(data, off)
        if length > len(data) - off - _HEADER.size:
            continue
        payload = data[off + _HEADER.size:off + _HEADER.size + length]
        # (a record of a kind this release does not know is a newer release's: whole, though not read here)
        if zlib.crc32(bytes([kind]) + payload) == crc and (kind not in _READ or not _decode(kind, payload,
                                                                                          Recovered())):
            return off
    return -1


def corrupt_where(data: bytes, offset: int) -> str:
    """Where a bad record at `offset` that is not a torn tail lies, for the operator: before whole records,
    or last in the log (then its full length is on disk and not all zeros, as no crash leaves a record)."""
    if _whole_record_after(data, offset) >= 0:
        return "with whole records after it"
    return ("the last record in the log, and not a torn tail: it was whole on disk, so it may have been "
            "acknowledged")


def torn_tail(data: bytes, rec: Recovered) -> bool:
    """Whether the bytes after the last whole record are a tail torn by a crash: the last record, cut short
    by the end of the file (a write that did not finish) or zero-filled to its end (a file extended before
    its data reached the disk), with no whole record after it. Anything else is corruption."""
    off = rec.bad_offset
    if off < 0:
        return True
    if off + _HEADER.size <= len(data):
        length, _, _ = _HEADER.unpack_from(data, off)
        end = off + _HEADER.size + length
        cut_short = end > len(data)
        zero_filled = not any(data[off + _HEADER.size:])
        if not (cut_short or zero_filled):
            return False
    return _whole_record_after(data, off) < 0


def _format_frame(store_format: int) -> bytes:
    return frame(KIND_FORMAT, _FORMAT.pack(store_format))


def _known_frame(known: dict[str, int]) -> bytes:
    return frame(KIND_KNOWN, pb.KnownVoters(enrolment=known).SerializeToString(deterministic=True))


class Store:
    """The node's durable consensus state. `open()` recovers; every `save_*`/`append_*` is durable on return,
    or raises `StoreFailed` (then nothing was acknowledged, and the store refuses writes until `resume()`)."""

    def __init__(self, path: str | Path | None = None, *, disk: Disk | None = None, sync: bool = True,
                 store_format: int = STORE_FORMAT) -> None:
        if (path is None) == (disk is None):
            raise StoreError("Store needs exactly one of path= or disk=")
        self.format = store_format  # read up to and written (another than STORE_FORMAT: a test's other release)
        self._disk: Disk = disk if disk is not None else FileDisk(path, sync=sync)  # type: ignore[arg-type]
        self._opened = False
        self.appends = 0
        self.size = 0  # bytes in the log: what compaction watches
        self.failed = ""  # why the store is fail-stopped ("" while it works)
        self.truncated = 0  # bytes of torn tail cut off by the last open()
        self.lost = 0  # acknowledged bytes the last open() found missing (cut at a record boundary)
        self._high = 0  # the high-water mark on disk: max(log size, a loss not yet settled)
        self.known: dict[str, int] = {}  # voter -> first enrolment id it enrolled here with (consensus/rebuild.py)
        self.rebuild: pb.RebuildMark | None = None  # this node's own last rebuild mark
        self.control: pb.ControlState | None = None  # the control-record state (kept by compaction)

    @property
    def where(self) -> str:
        return self._disk.where

    def open(self) -> Recovered:
        """Read the log, truncate a torn tail, and return the committed tables and acceptor state.
        Raises `StoreCorrupt` (changing nothing) when a bad record is not a torn tail, `StoreNewer` (changing
        nothing) at a record of a newer release."""
        data = self._disk.read_all()
        rec, end = parse(data, self.format)
        if rec.newer:
            raise StoreNewer(self.where, rec.bad_offset, rec.newer, self.format)
        if end < len(data):
            if not torn_tail(data, rec):
                raise StoreCorrupt(self.where, rec.bad_offset, rec.bad_reason, len(data),
                                   corrupt_where(data, rec.bad_offset))
            log.warning("%s: torn tail of %d bytes at offset %d (%s): a write cut short by a crash, never "
                        "acknowledged; truncated", self.where, len(data) - end, end, rec.bad_reason)
            self._disk.truncate(end)
        self.truncated = len(data) - end
        self.known, self.rebuild, self.control = dict(rec.known), rec.rebuild, rec.control
        self._opened = True
        self.size = end
        self.failed = ""
        high = self._read_high()
        self.lost = rec.lost_bytes = max(0, high - end) if high is not None else 0
        if self.lost:
            log.error("%s: the log ends at byte %d but had reached byte %d: %d bytes of acknowledged records are "
                      "missing (the file was cut short or replaced by an older copy); this node rejoins as a "
                      "learner and votes again once it has caught up", self.where, end, high, self.lost)
        self._high = max(end, high or 0)
        if high is None or high < end:
            self._write_high(sync=True)
        if rec.format < self.format:  # (format 1 has no format record: a log an older release can read)
            self._append(_format_frame(self.format))
        return rec

    def _read_high(self) -> int | None:
        raw = self._disk.read_mark()
        high = None if raw is None else _parse_mark(raw)
        if raw is not None and high is None:
            log.warning("%s: unreadable high-water mark (%d bytes); not checking for a cut log this time",
                        self.where, len(raw))
        return high

    def _write_high(self, sync: bool) -> None:
        try:
            self._disk.write_mark(_MARK.pack(_MARK_MAGIC, self._high), sync)
        except OSError as e:  # the log itself is durable; only the check of a later cut is weaker
            log.warning("%s: high-water mark not written (%s)", self.where, e.strerror or e)

    def settle_loss(self) -> None:
        """The node caught up past every version it may have voted on: the loss found at open() is settled."""
        if self.lost and self._opened:
            self.lost = 0
            self._high = self.size
            self._write_high(sync=True)

    recover = open

    def _append(self, data: bytes) -> None:
        if not self._opened:
            raise StoreError("store not opened: call open() (recovery) before writing")
        if self.failed:
            raise StoreFailed(self.failed)
        try:
            self._disk.append(data)
        except OSError as e:
            self._fail(f"write of {len(data)} bytes at offset {self.size} failed: {e.strerror or e}", e)
        self.appends += 1
        self.size += len(data)
        if self.size > self._high:
            self._high = self.size
            self._write_high(sync=False)

    @property
    def failure(self) -> str:
        """Why a node on this store neither votes nor commits now ("" while the store works)."""
        return f"store failed: {self.failed}" if self.failed else ""

    def _fail(self, what: str, e: OSError) -> None:
        self.failed = f"{self.where}: {what}"
        log.error("store fail-stopped: %s; refusing writes (and votes) until the disk recovers", self.failed)
        try:  # cut the partial record now, so that nothing can ever be appended after it
            self._disk.truncate(self.size)
        except OSError:
            pass  # resume() cuts it before anything else is written
        raise StoreFailed(self.failed) from e

    def resume(self, probe_bytes: int = 1 << 16) -> bool:
        """After a failed write: cut the log back to its last whole record and check that the disk takes
        `probe_bytes` again. True when the store works (again)."""
        if not self.failed:
            return True
        try:
            self._disk.truncate(self.size)
            self._disk.probe(probe_bytes)
        except OSError:
            return False
        log.warning("store resumed: %s is writable again (was: %s)", self.where, self.failed)
        self.failed = ""
        return True

    def append_commit(self, commit: pb.Commit, also: list[pb.AcceptorState] | None = None) -> None:
        """Append a commit, and any acceptor states riding along, with one write and one fsync."""
        data = frame(KIND_COMMIT, commit.SerializeToString())
        for st in also or ():
            data += frame(KIND_ACCEPTOR, st.SerializeToString())
        self._append(data)

    def save_acceptor(self, state: pb.AcceptorState) -> None:
        self._append(frame(KIND_ACCEPTOR, state.SerializeToString()))

    def enrol(self, voter: str, enrolment: int) -> bool:
        """Record that `voter` enrolled here from an empty store under `enrolment` (durable on return; kept by
        compaction). Returns whether it had enrolled here under another id. Only the first id is kept, never
        replaced: a voter that resumes a rebuild under a later id cannot pass for new once it was known."""
        first = self.known.get(voter)
        if first is None:
            known = {**self.known, voter: enrolment}
            self._append(_known_frame(known))
            self.known = known
        return first is not None and first != enrolment

    def save_rebuild(self, mark: pb.RebuildMark) -> None:
        """Record this node's own rebuild: started, or done (durable on return; an unfinished one is kept by
        compaction)."""
        self._append(frame(KIND_REBUILD, mark.SerializeToString()))
        self.rebuild = mark

    def save_control(self, state: pb.ControlState) -> None:
        """Record the control-record state (agent/consensus/control.py), durable on return; kept by compaction."""
        self._append(frame(KIND_CONTROL, state.SerializeToString()))
        self.control = state

    def compact(self, commits: list[pb.Commit], acceptor: list[pb.AcceptorState]) -> bool:
        """Replace the log by just these records (the commits still to keep, in order, and the acceptor state
        of undecided versions, the known voters and the control-record state), atomically: a crash leaves either the old log or the new one. A compaction
        that cannot be written leaves the old log in place (False); nothing is lost by skipping it."""
        if not self._opened:
            raise StoreError("store not opened: call open() (recovery) before compacting")
        if self.failed:
            return False
        data = b"".join(([_format_frame(self.format)] if self.format > 1 else [])
                        + [frame(KIND_COMMIT, c.SerializeToString()) for c in commits]
                        + [frame(KIND_ACCEPTOR, st.SerializeToString()) for st in acceptor]
                        + ([_known_frame(self.known)] if self.known else [])
                        + ([frame(KIND_REBUILD, self.rebuild.SerializeToString())]
                           if self.rebuild is not None and not self.rebuild.done else [])
                        + ([frame(KIND_CONTROL, self.control.SerializeToString())] if self.control is not None else []))
        # Lower the mark first, durably: a crash between the two leaves a log longer than its mark (checks
        # less), never a shorter one (a false alarm). A loss not yet settled keeps the mark at its high.
        new_high = len(data) if not self.lost else max(len(data), self._high)
        if new_high < self._high:
            self._high = new_high
            self._write_high(sync=True)
        try:
            self._disk.replace(data)
        except OSError as e:
            log.warning("%s: compaction skipped (%s); the log keeps growing until it can be written", self.where,
                        e.strerror or e)
            return False
        self.size = len(data)
        return True

    def close(self) -> None:
        self._disk.close()
        self._opened = False
