"""Certified tables: decode a consensus `Commit` into a RoutingTable only if its quorum certificate proves it.

A commit is certified when `qc.version == table.version`, `len(set(qc.voters)) >= qc.quorum >= 1`,
`table.content_hash == qc.table_hash`, and the hash recomputed from the decoded table
(`controlplane.table.RoutingTable.digest`) equals both. numpy only: the agent may import this module.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.table import RoutingTable, table_from_bytes
from controlplane.topology import Topology
from dataplane_shim.errors import Uncertified
from elasticmoe.v1 import consensus_pb2 as pb


def table_to_pb(table: RoutingTable) -> pb.RoutingTable:
    """Encode a table: phy2log as little-endian int64 bytes, content_hash = digest."""
    return pb.RoutingTable(
        version=table.version,
        parent=table.parent,
        layers=table.layers,
        slots=table.slots,
        experts=table.experts,
        slots_per_rank=table.topology.slots_per_rank,
        phy2log=table.phy2log.astype("<i8", copy=False).tobytes(),
        active_ranks=list(table.active_ranks),
        content_hash=table.digest,
        parent_hash=table.parent_hash,
    )


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


class TableWireError(ValueError):
    """A routing table from the network that cannot be decoded; the message names the field."""


def table_from_pb(m: pb.RoutingTable, topology: Topology | None = None) -> RoutingTable:
    """Decode `m`. `topology` (normally the receiver's head's) supplies the node/rank split; without it the
    ranks are derived from slots / slots_per_rank. Raises TableWireError naming the bad field."""
    if m.slots_per_rank == 0 or m.slots % m.slots_per_rank:
        raise TableWireError(f"table.slots_per_rank = {m.slots_per_rank}: expected a divisor of slots = {m.slots}")
    if max(m.version, m.parent) >= 2**63:  # the content hash encodes them as int64
        raise TableWireError(f"table.version = {m.version}, table.parent = {m.parent}: expected both < 2^63")
    if len(m.parent_hash) not in (0, 32):
        raise TableWireError(f"table.parent_hash has {len(m.parent_hash)} bytes: expected 32 (a sha256) or none")
    if m.layers == 0 or m.experts == 0:
        raise TableWireError(f"table.layers = {m.layers}, table.experts = {m.experts}: expected both >= 1")
    topo = topology or Topology(nodes=m.slots // m.slots_per_rank, ranks_per_node=1, slots_per_rank=m.slots_per_rank)
    if topo.slots != m.slots or topo.slots_per_rank != m.slots_per_rank:
        raise TableWireError(
            f"table.slots = {m.slots} with slots_per_rank = {m.slots_per_rank}: expected {topo.slots} "
            f"with {topo.slots_per_rank} (this node's topology)"
        )
    bad = [r for r in m.active_ranks if not 0 <= r < topo.ranks]
    if bad:
        raise TableWireError(f"table.active_ranks contains {bad}: expected ranks in 0..{topo.ranks - 1}")
    try:
        t = table_from_bytes(topo, m.experts, m.layers, m.phy2log, m.version, m.parent, tuple(m.active_ranks),
                             bytes(m.parent_hash))
    except (InvalidShape, InvalidTable) as e:
        raise TableWireError(f"table.phy2log: {e.message}") from None
    if m.content_hash and m.content_hash != t.digest:
        raise TableWireError(
            f"table.content_hash = {m.content_hash.hex()[:16]}..: the recomputed digest of the content is "
            f"{t.digest.hex()[:16]}.."
        )
    return t
