"""Device-resident, double-buffered, versioned routing tables and the lifecycle of this rank's slots.

Two `RouteTables` buffers on the engine's device: the active version's and a standby into which the next
certified version is copied ahead of time. `swap()` at a step boundary flips them (no copy on the
critical path). Slot lifecycle on this rank, per (layer, local slot):

    FREE -> STAGED   the engine's mover copies a new replica's weights into a free slot (`stage`)
    STAGED -> ACTIVE `swap`: the version that needs it becomes the one this rank runs
    ACTIVE -> RETAINED  `swap`: the new version no longer uses it, but peers may still address it
    RETAINED -> FREE `release_ready`: once every peer's counter shows the new version (RELEASED)

A slot the new version fills with another expert while the running one still uses it (or retains it)
cannot be staged early; it is overwritten inside `swap` and counted in `forced`. Versions not newer than
the head, and commits whose quorum certificate fails, are refused and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidTable
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.certify import table_from_commit
from dataplane_shim.counters import VersionCounters
from dataplane_shim.errors import BadInput, StaleVersion
from dataplane_shim.router import RouteTables
from elasticmoe.v1 import consensus_pb2 as pb

I64 = npt.NDArray[np.int64]
# mover(layers [n], local_slots [n], experts [n]): copy expert weights into the slots; expert -1 = release.
Mover = Callable[[I64, I64, I64], None]


class SlotState(IntEnum):
    FREE = 0
    STAGED = 1
    ACTIVE = 2
    RETAINED = 3


_FREE, _STAGED, _ACTIVE, _RETAINED = (int(s) for s in SlotState)


@dataclass
class StoreStats:
    offered: int = 0
    refused_stale: int = 0
    staged: int = 0
    forced: int = 0
    swaps: int = 0
    released: int = 0


class TableStore:
    """This rank's view of the routing tables: active, pending (staging) and previous (retained) versions."""

    def __init__(
        self,
        topo: Topology,
        rank: int,
        initial: RoutingTable,
        *,
        device: Any = "cpu",
        mover: Mover | None = None,
        counters: VersionCounters | None = None,
        peers: Sequence[int] | None = None,
        voters: Sequence[str] | None = None,
    ) -> None:
        if not 0 <= rank < topo.ranks:
            raise BadInput(f"rank={rank}: expected 0..{topo.ranks - 1}")
        if initial.topology.slots != topo.slots:
            raise BadInput(f"initial table has {initial.topology.slots} slots: the pool has {topo.slots}")
        self.topo, self.rank, self.mover, self.counters = topo, rank, mover, counters
        self.voters = None if voters is None else tuple(voters)  # when known: certificates must name them
        self.peers = np.asarray(range(topo.ranks) if peers is None else peers, dtype=np.int64)
        L, E = initial.layers, initial.experts
        self._buffers = (RouteTables(L, E, topo.slots, device), RouteTables(L, E, topo.slots, device))
        self._buffers[0].load(initial, rank)
        self._active_buf = 0
        self.active: RoutingTable = initial
        self.pending: RoutingTable | None = None
        self.previous: RoutingTable | None = None
        S = topo.slots_per_rank
        self._lo = rank * S
        self.resident: I64 = self._local(initial).copy()  # [L, S] expert each local slot holds
        self.state = np.where(self.resident >= 0, SlotState.ACTIVE, SlotState.FREE).astype(np.int8)
        self._todo = np.zeros_like(self.resident, dtype=bool)  # [L, S] slots the pending version must load
        self.stats = StoreStats()
        if counters is not None:
            counters.publish(rank, initial.version)

    # ---- views -------------------------------------------------------------------------------
    def _local(self, table: RoutingTable) -> I64:
        return table.phy2log[:, self._lo : self._lo + self.topo.slots_per_rank]

    @property
    def head(self) -> int:
        return self.pending.version if self.pending is not None else self.active.version

    def tables_for(self, version: int) -> RouteTables | None:
        """The device buffer holding `version`, if it is the active or the pending one."""
        if version == self.active.version:
            return self._buffers[self._active_buf]
        if self.pending is not None and version == self.pending.version:
            return self._buffers[1 - self._active_buf]
        return None

    @property
    def active_tables(self) -> RouteTables:
        return self._buffers[self._active_buf]

    # ---- install ---------------------------------------------------------------------------
    def offer_commit(self, commit: pb.Commit) -> RoutingTable:
        """Verify `commit`'s certificate (raises Uncertified), then `offer` its table."""
        table = table_from_commit(commit, self.topo, self.voters)
        self.offer(table)
        return table

    def offer(self, table: RoutingTable) -> None:
        """Make `table` the pending version (replacing an older pending one); raises StaleVersion if not newer."""
        self.stats.offered += 1
        if table.version <= self.head:
            self.stats.refused_stale += 1
            raise StaleVersion(f"version {table.version} offered: this rank already holds {self.head}")
        if table.phy2log.shape != self.active.phy2log.shape or table.experts != self.active.experts:
            raise BadInput(f"version {table.version} has shape {table.phy2log.shape} x {table.experts} experts: "
                           f"expected {self.active.phy2log.shape} x {self.active.experts}")
        try:  # a certificate proves who voted, not that they checked: never route by an invalid table
            table.validate()
        except InvalidTable as e:
            raise BadInput(f"version {table.version} is not a valid table: {e.message}") from None
        if self.pending is not None:  # superseded: staged slots the new version does not want go back to free
            unwanted = (self.state == SlotState.STAGED) & (self._local(table) != self.resident)
            self._move(unwanted, np.full_like(self.resident, -1))
            self.state[unwanted] = SlotState.FREE
        self._buffers[1 - self._active_buf].load(table, self.rank)
        self.pending = table
        new = self._local(table)
        self._todo = (new >= 0) & (new != self.resident)

    def stage(self, limit: int | None = None) -> int:
        """Load up to `limit` (default all) pending slots that are free now; returns how many remain to load."""
        can = self._todo & (self.state == SlotState.FREE)
        if limit is not None:
            flat = np.flatnonzero(can)[: max(0, limit)]
            can = np.zeros_like(can)
            can.ravel()[flat] = True
        if can.any() and self.pending is not None:
            self._move(can, self._local(self.pending))
            self.state[can] = SlotState.STAGED
            self._todo &= ~can
            self.stats.staged += int(can.sum())
        return int(self._todo.sum())

    def ready(self) -> bool:
        """True when every pending slot that can load before the swap has loaded."""
        return self.pending is not None and not (self._todo & (self.state == SlotState.FREE)).any()

    def swap(self) -> bool:
        """At a step boundary: activate the pending version if ready; publish it. Returns whether it swapped."""
        if self.pending is None or not self.ready():
            return False
        new_table = self.pending
        new = self._local(new_table)
        if self._todo.any():  # still in use or retained: overwritten now, at the boundary
            self.stats.forced += int(self._todo.sum())
            self._move(self._todo, new)
        keep = (new < 0) & (self.resident >= 0)  # no longer used, still resident: retained until peers catch up
        self.state = np.where(new >= 0, _ACTIVE, np.where(keep, _RETAINED, _FREE)).astype(np.int8)
        self.previous, self.active, self.pending = self.active, new_table, None
        self._active_buf = 1 - self._active_buf
        self._todo[:] = False
        self.stats.swaps += 1
        if self.counters is not None:
            self.counters.publish(self.rank, new_table.version)
        return True

    def release_ready(self) -> int:
        """Release retained slots once every peer's counter shows the active version; returns how many."""
        retained = self.state == SlotState.RETAINED
        if not retained.any() or self.counters is None:
            return 0
        if int(self.counters.read()[self.peers].min()) < self.active.version:
            return 0
        self._move(retained, np.full_like(self.resident, -1))
        self.state[retained] = SlotState.FREE
        n = int(retained.sum())
        self.stats.released += n
        return n

    def _move(self, mask: npt.NDArray[np.bool_], experts: I64) -> None:
        if not mask.any():
            return
        layers, slots = np.nonzero(mask)
        exp = experts[layers, slots]
        if self.mover is not None:
            self.mover(layers.astype(np.int64), slots.astype(np.int64), exp.astype(np.int64))
        self.resident[layers, slots] = exp

    # ---- receive side ------------------------------------------------------------------------
    def accepts(self, version: int, layers: I64, slots: I64) -> npt.NDArray[np.bool_]:
        """Receiver check of tokens tagged `version` for global `slots` of `layers` ([n] each) -> [n] bool.

        Accepted iff the tag is the active version, or the previous one whose slot is still resident
        (ACTIVE unchanged or RETAINED), and the slot lives on this rank.
        """
        layers, slots = np.asarray(layers, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if version == self.active.version:
            table = self.active
        elif self.previous is not None and version == self.previous.version:
            table = self.previous
        else:
            return np.zeros(slots.shape, dtype=bool)
        local = slots - self._lo
        mine = (local >= 0) & (local < self.topo.slots_per_rank)
        lc = np.where(mine, local, 0)
        want = table.phy2log[layers, np.where(mine, slots, 0)]
        ok: npt.NDArray[np.bool_] = mine & (want >= 0) & (self.resident[layers, lc] == want)
        return ok
