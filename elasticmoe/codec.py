"""The routing table's wire form (consensus_pb2.RoutingTable), one codec for every side that sends or receives
a table: the consensus (proposals, commits, catch-up), the admin service, and the engine plugins (which also
verify a commit's certificate: dataplane_shim.certify). Hand-written beside the generated code it encodes."""

from __future__ import annotations

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.table import RoutingTable, table_from_bytes
from controlplane.topology import Topology
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
