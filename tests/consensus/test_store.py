"""Store: framing, recovery of whole records, torn and corrupt tails, ordering of acceptor state."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.storage.store import (
    FileDisk,
    MemoryDisk,
    Store,
    StoreCorrupt,
    StoreError,
    StoreFailed,
    frame,
    parse,
)
from elasticmoe.v1 import consensus_pb2 as pb


def commit(v: int) -> pb.Commit:
    return pb.Commit(table=pb.RoutingTable(version=v, parent=v - 1, content_hash=bytes([v]) * 32),
                     qc=pb.QuorumCertificate(version=v, table_hash=bytes([v]) * 32, voters=["a", "b"], quorum=2))


def test_roundtrip_file(tmp_path: Path) -> None:
    s = Store(tmp_path / "log")
    assert s.open().records == 0
    for v in range(2, 6):
        s.append_commit(commit(v))
    s.save_acceptor(pb.AcceptorState(version=6, promised=pb.Ballot(round=1, node_id="a")))
    s.save_acceptor(pb.AcceptorState(version=6, promised=pb.Ballot(round=3, node_id="b"), proposer_round=2))
    s.close()
    rec = Store(tmp_path / "log").open()
    assert [c.table.version for c in rec.commits] == [2, 3, 4, 5]
    assert rec.acceptor[6].promised.round == 3 and rec.acceptor[6].proposer_round == 2  # last record wins
    assert rec.torn_bytes == 0


@pytest.mark.parametrize("cut", [1, 5, 9, 20])
def test_torn_tail_is_dropped_and_truncated(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    s.append_commit(commit(2))
    s.append_commit(commit(3))
    s.close()
    whole = p.read_bytes()
    last = frame(1, commit(3).SerializeToString())
    p.write_bytes(whole[: len(whole) - len(last) + cut])  # the second record torn after `cut` bytes
    s2 = Store(p)
    rec = s2.open()
    assert [c.table.version for c in rec.commits] == [2]
    assert rec.torn_bytes == cut
    s2.append_commit(commit(3))  # appends after the last whole record, not after the garbage
    s2.close()
    assert [c.table.version for c in Store(p).open().commits] == [2, 3]


def test_corrupt_record_stops_recovery() -> None:
    d = MemoryDisk()
    s = Store(disk=d)
    s.open()
    for v in (2, 3, 4):
        s.append_commit(commit(v))
    second = len(frame(1, commit(2).SerializeToString()))
    d.data[second + 12] ^= 0xFF  # flip a payload byte of record 2: its crc no longer matches
    rec, end = parse(bytes(d.data))
    assert [c.table.version for c in rec.commits] == [2]
    assert end == second


def test_memory_disk_tear_and_write_before_open() -> None:
    d = MemoryDisk()
    s = Store(disk=d)
    with pytest.raises(StoreError, match="not opened"):
        s.append_commit(commit(2))
    s.open()
    s.append_commit(commit(2))
    d.tear(b"\xff\xff\x00")
    rec = Store(disk=d).open()
    assert [c.table.version for c in rec.commits] == [2] and rec.torn_bytes == 3
    assert len(d.data) == len(frame(1, commit(2).SerializeToString()))


def test_store_needs_path_or_disk(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="exactly one"):
        Store()
    with pytest.raises(StoreError, match="exactly one"):
        Store(tmp_path / "x", disk=MemoryDisk())
    FileDisk(tmp_path / "sub" / "log").close()
    assert (tmp_path / "sub" / "log").exists()


def test_compaction_replaces_the_log_atomically(tmp_path: Path) -> None:
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    for v in range(2, 12):
        s.append_commit(commit(v))
        s.save_acceptor(pb.AcceptorState(version=v + 1, promised=pb.Ballot(round=1, node_id="a")))
    before = s.size
    s.compact([commit(10), commit(11)], [pb.AcceptorState(version=12, proposer_round=1)])
    assert 0 < s.size < before and s.size == p.stat().st_size
    s.append_commit(commit(12))  # appends go to the new file
    s.close()
    assert not (tmp_path / "log.compact").exists()
    rec = Store(p).open()
    assert [c.table.version for c in rec.commits] == [10, 11, 12]
    assert list(rec.acceptor) == [12] and rec.acceptor[12].proposer_round == 1


# ---- torn tail or corruption: only a tail a crash tore is cut; anything else refuses to start ----------
def _log_of(n: int) -> tuple[MemoryDisk, list[int]]:
    d = MemoryDisk()
    s = Store(disk=d)
    s.open()
    offsets = []
    for v in range(2, 2 + n):
        offsets.append(len(d.data))
        s.append_commit(commit(v))
    return d, offsets


def test_mid_file_corruption_refuses_to_start_and_names_the_offset() -> None:
    d, offsets = _log_of(4)
    d.data[offsets[1] + 12] ^= 0xFF  # a payload byte of the second record
    before = bytes(d.data)
    with pytest.raises(StoreCorrupt) as e:
        Store(disk=d).open()
    assert e.value.offset == offsets[1] and "crc mismatch" in e.value.reason
    assert f"offset {offsets[1]}" in str(e.value) and "emoe store repair" in str(e.value)
    assert bytes(d.data) == before  # nothing was truncated


@pytest.mark.parametrize("where", ["length", "kind", "crc"])
def test_a_bad_header_mid_file_is_corruption(where: str) -> None:
    d, offsets = _log_of(3)
    d.data[offsets[1] + {"length": 0, "kind": 8, "crc": 5}[where]] ^= 0x40
    with pytest.raises(StoreCorrupt) as e:
        Store(disk=d).open()
    assert e.value.offset == offsets[1]


def test_a_flipped_byte_in_the_last_whole_record_is_corruption_not_a_torn_tail() -> None:
    d, offsets = _log_of(3)
    d.data[-3] ^= 0x01  # the record has its full length: no crash tears a write that way
    with pytest.raises(StoreCorrupt) as e:
        Store(disk=d).open()
    assert e.value.offset == offsets[2]
    msg = str(e.value)  # it says what it is: the last record, whole on disk, not a torn tail
    assert "the last record" in msg and "not a torn tail" in msg and "may have been acknowledged" in msg, msg
    assert "whole records after it" not in msg, msg


def test_a_corrupt_record_with_whole_records_after_it_says_so() -> None:
    d, offsets = _log_of(3)
    d.data[offsets[1] + 12] ^= 0x01
    with pytest.raises(StoreCorrupt) as e:
        Store(disk=d).open()
    assert e.value.offset == offsets[1]
    assert "with whole records after it" in str(e.value) and "the last record" not in str(e.value), str(e.value)


@pytest.mark.parametrize("last", [True, False], ids=["last-record", "records-after"])
def test_store_check_describes_where_the_corrupt_record_is(last: bool, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    d, offsets = _log_of(3)
    bad = offsets[2] if last else offsets[1]
    d.data[bad + 12] ^= 0x01  # a payload byte: the record keeps its full length, its crc no longer matches
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "consensus").write_bytes(bytes(d.data))
    (tmp_path / "agent.toml").write_text(f'node_id = "n"\ndata_dir = "{tmp_path / "data"}"\n')
    assert main(["store", "check", "--config", str(tmp_path / "agent.toml")]) == 1
    err = capsys.readouterr().err
    assert f"bad record at offset {bad} (crc mismatch)" in err and "emoe store repair" in err, err
    if last:
        assert "the last record" in err and "not a torn tail" in err and "whole records after" not in err, err
    else:
        assert "with whole records after it" in err and "the last record" not in err, err


def test_a_zero_filled_tail_is_torn() -> None:
    d, offsets = _log_of(3)
    rec_len = len(d.data) - offsets[2]
    d.data[offsets[2] + 9:] = bytes(rec_len - 9)  # the file grew before the record's data reached the disk
    s = Store(disk=d)
    rec = s.open()
    assert [c.table.version for c in rec.commits] == [2, 3] and s.truncated == rec_len


# ---- fail-stop on write errors ---------------------------------------------------------------------
def test_disk_full_fail_stops_then_resumes_without_losing_a_record() -> None:
    d, _ = _log_of(2)
    s = Store(disk=d)
    s.open()
    d.capacity = len(d.data) + 20  # room for part of the next record only
    with pytest.raises(StoreFailed, match="No space left"):
        s.append_commit(commit(4))
    assert s.failed and len(d.data) == s.size  # the partial record was cut at once
    with pytest.raises(StoreFailed):  # nothing more is written (nor acknowledged) while failed
        s.save_acceptor(pb.AcceptorState(version=5))
    assert not s.resume()  # still full
    d.capacity = None  # space returns
    assert s.resume() and not s.failed
    s.append_commit(commit(4))
    rec = Store(disk=d).open()
    assert [c.table.version for c in rec.commits] == [2, 3, 4] and rec.torn_bytes == 0


def test_compaction_that_cannot_be_written_keeps_the_old_log(tmp_path: Path) -> None:
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    s.append_commit(commit(2))
    (tmp_path / "log.compact").mkdir()  # the temp file cannot be created
    assert not s.compact([commit(2)], [])
    s.append_commit(commit(3))
    assert [c.table.version for c in Store(p).open().commits] == [2, 3]


# ---- a log cut at a record boundary: the high-water mark beside it says acknowledged records are gone ----
def test_a_log_cut_at_a_record_boundary_reports_the_missing_bytes(tmp_path: Path) -> None:
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    for v in range(2, 6):
        s.append_commit(commit(v))
    s.close()
    whole = p.read_bytes()
    ends = parse(whole)[0].ends
    p.write_bytes(whole[:ends[1]])  # versions 4 and 5 gone; what is left parses cleanly
    s2 = Store(p)
    rec = s2.open()
    assert [c.table.version for c in rec.commits] == [2, 3] and rec.torn_bytes == 0
    assert rec.lost_bytes == s2.lost == len(whole) - ends[1]
    s2.append_commit(commit(4))  # still short of the mark: a restart now is still a loss
    s2.close()
    s3 = Store(p)
    assert s3.open().lost_bytes > 0
    s3.settle_loss()  # the node caught up: the mark comes down to the log
    s3.close()
    assert Store(p).open().lost_bytes == 0


def test_the_mark_never_raises_a_false_alarm(tmp_path: Path) -> None:
    """A mark behind the log (a crash between the log's fsync and the mark's write), compaction, a torn tail
    and a log with no mark at all (written before marks existed) are no loss."""
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    for v in range(2, 12):
        s.append_commit(commit(v))
    s.compact([commit(10), commit(11)], [])  # the log shrinks; the mark comes down first
    s.append_commit(commit(12))
    s.close()
    assert Store(p).open().lost_bytes == 0
    mark = p.with_name("log.mark")
    assert mark.exists()
    s = Store(p)
    s.open()
    old_mark = mark.read_bytes()
    s.append_commit(commit(13))
    s.close()
    mark.write_bytes(old_mark)  # the mark write of commit 13 never reached the disk
    assert Store(p).open().lost_bytes == 0
    with p.open("ab") as f:
        f.write(frame(1, commit(14).SerializeToString())[:7])  # a torn tail
    assert Store(p).open().lost_bytes == 0
    mark.unlink()
    s = Store(p)
    assert s.open().lost_bytes == 0 and mark.exists()  # and from now on it is checked again


def test_an_unsettled_loss_survives_compaction() -> None:
    d = MemoryDisk()
    s = Store(disk=d)
    s.open()
    for v in range(2, 8):
        s.append_commit(commit(v))
    del d.data[parse(bytes(d.data))[0].ends[2]:]
    s2 = Store(disk=d)
    assert s2.open().lost_bytes > 0
    s2.compact([commit(4)], [])
    assert Store(disk=d).open().lost_bytes > 0
