"""Cluster topology: nodes, ranks, slots per rank, and the bandwidth of each transfer tier."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidTopology


class Tier(IntEnum):
    """Where a weight copy travels, nearest first."""

    SAME_RANK = 0
    SAME_NODE = 1  # NVLink within a node
    OTHER_NODE = 2  # RDMA between nodes
    HOST = 3  # reload from host memory / storage


# H200 figures (per direction, per GPU), bytes per second:
#  - NVLink 4 on H200 SXM: 900 GB/s aggregate bidirectional -> ~450 GB/s one way; we plan with 300 GB/s
#    effective for a single peer-to-peer copy (NCCL p2p measurements on H100/H200 reach 250-370 GB/s).
#  - ConnectX-7 400 Gb/s InfiniBand per GPU: 50 GB/s line rate, ~40 GB/s effective.
#  - PCIe Gen5 x16 host-to-device: 64 GB/s line rate, ~25 GB/s effective from pinned host memory.
#  - same rank: a device-local copy at HBM3e speed (4.8 TB/s read+write -> ~2 TB/s copy).
DEFAULT_TIER_BANDWIDTH = (2.0e12, 300e9, 40e9, 25e9)


@dataclass(frozen=True)
class Topology:
    """`nodes` x `ranks_per_node` ranks, each with `slots_per_rank` expert slots per layer.

    Global rank g sits on node g // ranks_per_node; slot p lives on rank p // slots_per_rank.
    """

    nodes: int
    ranks_per_node: int
    slots_per_rank: int
    tier_bandwidth: tuple[float, float, float, float] = DEFAULT_TIER_BANDWIDTH

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "slots_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidTopology(f"{name}={value!r}: expected an integer >= 1")
        if len(self.tier_bandwidth) != 4 or any(not (b > 0) for b in self.tier_bandwidth):
            raise InvalidTopology(f"tier_bandwidth={self.tier_bandwidth!r}: expected 4 positive bytes/s figures")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def slots(self) -> int:
        """P = G x S slots per layer."""
        return self.ranks * self.slots_per_rank

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def slot_ranks(self) -> npt.NDArray[np.int64]:
        """[P] rank of each slot."""
        return np.arange(self.slots, dtype=np.int64) // self.slots_per_rank

    def tier(self, src_rank: int, dst_rank: int) -> Tier:
        """Tier of a copy from `src_rank` (-1 = host) to `dst_rank`."""
        if src_rank < 0:
            return Tier.HOST
        if src_rank == dst_rank:
            return Tier.SAME_RANK
        if self.node_of(src_rank) == self.node_of(dst_rank):
            return Tier.SAME_NODE
        return Tier.OTHER_NODE

    def bandwidth(self, src_rank: int, dst_rank: int) -> float:
        return float(self.tier_bandwidth[self.tier(src_rank, dst_rank)])
