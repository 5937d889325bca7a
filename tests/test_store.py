"""Store: framing, recovery of whole records, torn and corrupt tails, ordering of acceptor state."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.store import FileDisk, MemoryDisk, Store, StoreError, frame, parse
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
