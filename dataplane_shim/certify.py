"""Certified tables: decode a consensus `Commit` into a RoutingTable only if its quorum certificate proves it.

A commit is certified when `qc.version == table.version`, `len(set(qc.voters)) >= qc.quorum >= 1`,
`table.content_hash == qc.table_hash`, and the hash recomputed from the decoded table
(`controlplane.table.RoutingTable.digest`) equals both. numpy only: the agent may import this module.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.errors import Uncertified
from elasticmoe.codec import TableWireError, table_from_pb, table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb


def certified_commit(table: RoutingTable, voters: Sequence[str], quorum: int) -> pb.Commit:
    """A Commit for `table` with a certificate naming `voters` (tests, the reference engine, the agent's fakes)."""
    qc = pb.QuorumCertificate(version=table.version, table_hash=table.digest, voters=list(voters), quorum=quorum)
    return pb.Commit(table=table_to_pb(table), qc=qc)


def table_from_commit(commit: pb.Commit, topo: Topology, voters: Collection[str] | None = None) -> RoutingTable:
    """Decode and verify `commit` for a pool of shape `topo`; raises Uncertified naming the failed check.
    With `voters` (the configured voter ids), the certificate must also name a majority of them and no one
    else, and its quorum must be that majority."""
    t, qc = commit.table, commit.qc
    voters_cfg = None if voters is None else set(voters)
    if not commit.HasField("table") or not commit.HasField("qc"):
        raise Uncertified("commit lacks its table or its quorum certificate")
    if qc.version != t.version:
        raise Uncertified(f"qc.version={qc.version} but table.version={t.version}")
    if max(t.version, t.parent) >= 2**63:  # the digest encodes them as int64
        raise Uncertified(f"table.version={t.version}, table.parent={t.parent}: expected both < 2^63")
    voters = set(qc.voters)
    if qc.quorum < 1 or len(voters) < qc.quorum:
        raise Uncertified(f"version {t.version}: {len(voters)} distinct voters for quorum {qc.quorum}")
    if voters_cfg is not None:
        strangers = sorted(voters - voters_cfg)
        need = len(voters_cfg) // 2 + 1
        if strangers:
            raise Uncertified(f"version {t.version}: qc.voters names non-voters {strangers}")
        if qc.quorum != need:
            raise Uncertified(f"version {t.version}: qc.quorum={qc.quorum}: expected a majority of "
                              f"{len(voters_cfg)} voters = {need}")
    if t.slots_per_rank != topo.slots_per_rank or t.slots != topo.slots:
        raise Uncertified(
            f"version {t.version}: table has {t.slots} slots, {t.slots_per_rank} per rank; the pool has "
            f"{topo.slots}, {topo.slots_per_rank} per rank"
        )
    if bytes(qc.table_hash) != bytes(t.content_hash):
        raise Uncertified(f"version {t.version}: qc.table_hash does not match table.content_hash")
    try:
        table = table_from_pb(t, topo)
    except TableWireError as exc:
        raise Uncertified(f"version {t.version}: undecodable table: {exc}") from exc
    if table.digest != bytes(qc.table_hash):
        raise Uncertified(f"version {t.version}: recomputed digest differs from the certified hash")
    return table
