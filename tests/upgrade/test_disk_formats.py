"""On disk (elasticmoe/versions.py): this release writes the consensus log the previous one reads; a log of a
newer format or record kind, or a data_dir of a newer format, is refused by name and left as it was (an agent
on one does not start, and says why); the newer release reads its own."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import uvloop

from agent.config import from_dict
from agent.process import AgentProcess, StartupError
from agent.storage.datadir import DataDirError, data_dir_format, mark_owner, owner
from agent.storage.store import _KINDS, KIND_FORMAT, Store, StoreCorrupt, StoreNewer, frame, parse
from chaos.localcluster import free_ports
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.versions import STORE_FORMAT

NEWER_KIND = max(_KINDS) + 1  # a record kind no release so far writes


def _commit(v: int) -> cpb.Commit:
    return cpb.Commit(table=cpb.RoutingTable(version=v, parent=v - 1, content_hash=bytes([v]) * 32),
                      qc=cpb.QuorumCertificate(version=v, table_hash=bytes([v]) * 32, voters=["a", "b"], quorum=2))


def test_this_release_writes_format_1_with_no_format_record(tmp_path: Path) -> None:
    s = Store(tmp_path / "log")
    s.open()
    s.append_commit(_commit(2))
    s.compact([_commit(2)], [])
    s.close()
    data = (tmp_path / "log").read_bytes()
    assert STORE_FORMAT == 1 and data == frame(1, _commit(2).SerializeToString())  # what the previous release reads


def test_a_record_kind_of_a_newer_release_is_refused_by_name_and_left_as_it_is(tmp_path: Path) -> None:
    p = tmp_path / "log"
    s = Store(p)
    s.open()
    s.append_commit(_commit(2))
    s.close()
    p.write_bytes(p.read_bytes() + frame(NEWER_KIND, b"a newer release's record") + frame(1, _commit(3).SerializeToString()))
    before = p.read_bytes()
    with pytest.raises(StoreNewer) as e:
        Store(p).open()
    assert f"a record of kind {NEWER_KIND}, which store format 1 does not have" in str(e.value) and "newer release" in str(e.value)
    first = len(frame(1, _commit(2).SerializeToString()))
    assert e.value.offset == first
    assert p.read_bytes() == before  # neither truncated nor changed
    # a damaged record before it is corruption (a whole record after it, if only a newer release's), not a torn
    # tail to cut off: here its length runs past the end of the log, as a write cut short by a crash would
    damaged = struct.pack("<I", 1 << 16) + before[4:first] + frame(NEWER_KIND, b"a newer release's record")
    p.write_bytes(damaged)
    with pytest.raises(StoreCorrupt, match="with whole records after it"):
        Store(p).open()
    assert p.read_bytes() == damaged


def test_a_log_of_a_newer_store_format_is_refused_and_the_newer_release_reads_it(tmp_path: Path) -> None:
    p = tmp_path / "log"
    old = Store(p)
    old.open()
    old.append_commit(_commit(2))
    old.close()
    newer = Store(p, store_format=STORE_FORMAT + 1)  # a newer release opens an older log: marks it as its own
    assert [c.table.version for c in newer.open().commits] == [2]
    newer.append_commit(_commit(3))
    newer.close()
    before = p.read_bytes()
    with pytest.raises(StoreNewer) as e:
        Store(p).open()
    assert f"a record of store format {STORE_FORMAT + 1}" in str(e.value)
    assert f"reads store formats up to {STORE_FORMAT}" in str(e.value) and p.read_bytes() == before
    again = Store(p, store_format=STORE_FORMAT + 1)
    rec = again.open()
    assert [c.table.version for c in rec.commits] == [2, 3] and rec.format == STORE_FORMAT + 1
    again.compact([_commit(3)], [])  # compaction keeps the format record first
    again.close()
    assert parse(p.read_bytes(), STORE_FORMAT + 1)[0].format == STORE_FORMAT + 1
    assert p.read_bytes()[8] == KIND_FORMAT
    with pytest.raises(StoreNewer):
        Store(p).open()


def test_a_data_dir_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    assert data_dir_format(tmp_path) == 1  # before the FORMAT file (the previous release's data_dirs)
    mark_owner(tmp_path, "n1")
    assert (tmp_path / "FORMAT").read_text() == "1\n" and owner(tmp_path, "n1")
    (tmp_path / "FORMAT").write_text("2\n")
    with pytest.raises(DataDirError, match="has format 2, written by a newer release; this agent knows data_dir "
                                           "formats up to 1"):
        owner(tmp_path, "n1")
    (tmp_path / "FORMAT").write_text("two\n")
    with pytest.raises(DataDirError, match="not a format number"):
        owner(tmp_path, "n1")


def test_an_agent_on_a_newer_log_does_not_start_and_says_why(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "consensus").write_bytes(frame(7, b"newer"))
    cfg = from_dict({"node_id": "n1", "profile": "test", "listen": f"127.0.0.1:{free_ports(1)[0]}", "seeds": [],
                     "data_dir": str(data), "shim_socket": str(tmp_path / "shim.sock"),
                     "cluster": {"nodes": 1, "ranks_per_node": 1, "slots_per_rank": 4, "layers": 1, "experts": 4,
                                 "top_k": 1}})

    async def main() -> str:
        try:
            await AgentProcess(cfg).start()
        except StartupError as e:
            return str(e)
        raise AssertionError("the agent started on a log of a newer release")

    why = uvloop.run(main())
    assert "a record of kind 7" in why and "written by a newer release" in why, why
    assert (data / "consensus").read_bytes() == frame(7, b"newer")
