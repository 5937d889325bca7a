"""RoutingTable <-> consensus_pb2.RoutingTable, checking the content hash on the way in."""

from __future__ import annotations

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.table import RoutingTable, table_from_bytes
from controlplane.topology import Topology

# table_to_pb is re-exported: one encoder, shared with the shim
from dataplane_shim.certify import table_to_pb as table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb


class TableWireError(ValueError):
    """A routing table from the network that cannot be decoded; the message names the field."""


def table_from_pb(m: pb.RoutingTable, topology: Topology | None = None) -> RoutingTable:
    """Decode `m`. `topology` (normally the receiver's head's) supplies the node/rank split; without it the
    ranks are derived from slots / slots_per_rank. Raises TableWireError naming the bad field."""
    if m.slots_per_rank == 0 or m.slots % m.slots_per_rank:
        raise TableWireError(f"table.slots_per_rank = {m.slots_per_rank}: expected a divisor of slots = {m.slots}")
    if max(m.version, m.parent) >= 2**63:  # the content hash encodes them as int64
        raise TableWireError(f"table.version = {m.version}, table.parent = {m.parent}: expected both < 2^63")
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
        t = table_from_bytes(topo, m.experts, m.layers, m.phy2log, m.version, m.parent, tuple(m.active_ranks))
    except (InvalidShape, InvalidTable) as e:
        raise TableWireError(f"table.phy2log: {e.message}") from None
    if m.content_hash and m.content_hash != t.digest:
        raise TableWireError(
            f"table.content_hash = {m.content_hash.hex()[:16]}..: expected {t.digest.hex()[:16]}.. for the content"
        )
    return t
