"""Static expert parallelism: every expert on one rank, in contiguous blocks, never moved."""

from __future__ import annotations

from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology


def static_table(topo: Topology, layers: int, experts: int) -> RoutingTable:
    """The static EP placement (version 1): expert e on rank e * G // E, spare slots left empty."""
    return initial_table(topo, layers, experts)
