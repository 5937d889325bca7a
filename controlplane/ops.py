"""Operations on a routing table: plain data you can print, compare, persist and explain.

`apply_ops(table, ops)` gives the successor table (version + 1) or raises InvalidOperation with a
stable reason code. Validity of the result (every expert still served) is checked by the caller with
`RoutingTable.validate()`, because a Drain is only valid together with the Repairs that follow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from controlplane.errors import InvalidOperation, InvalidReason
from controlplane.table import I64, RoutingTable


class OpKind(StrEnum):
    REPLICATE = "replicate"
    CONSOLIDATE = "consolidate"
    MIGRATE = "migrate"
    DRAIN = "drain"
    RESTORE = "restore"
    REPAIR = "repair"
    SWAP = "swap"
    DROP = "drop"


@dataclass(frozen=True, order=True)
class Replicate:
    """Add a replica of `expert` in layer `layer` to a free slot of rank `dst`."""

    layer: int
    expert: int
    dst: int
    kind: OpKind = OpKind.REPLICATE


@dataclass(frozen=True, order=True)
class Consolidate:
    """Leave each of `experts` (layer `layer`) with one replica, on rank `dst`, freeing its other slots.

    A replica already on `dst` keeps its slot (no copy); otherwise the expert takes dst's first free slot."""

    layer: int
    experts: tuple[int, ...]
    dst: int
    kind: OpKind = OpKind.CONSOLIDATE


@dataclass(frozen=True, order=True)
class Migrate:
    """Move the replica of `expert` on rank `src` to a free slot of rank `dst`."""

    layer: int
    expert: int
    src: int
    dst: int
    kind: OpKind = OpKind.MIGRATE


@dataclass(frozen=True, order=True)
class Drain:
    """Take `rank` out of the active set and empty its slots (pair with Repairs for lone replicas)."""

    rank: int
    kind: OpKind = OpKind.DRAIN


@dataclass(frozen=True, order=True)
class Restore:
    """Return `rank` to the active set with empty slots."""

    rank: int
    kind: OpKind = OpKind.RESTORE


@dataclass(frozen=True, order=True)
class Repair:
    """Re-home `expert` of `layer` on rank `dst`, copied from rank `source` (-1: reload from host)."""

    layer: int
    expert: int
    dst: int
    source: int
    kind: OpKind = OpKind.REPAIR


@dataclass(frozen=True, order=True)
class Swap:
    """Exchange `expert` on rank `src` with `other` on rank `dst` (each takes the other's slot): the move
    between two full ranks that no Migrate can express. Two copies."""

    layer: int
    expert: int
    src: int
    other: int
    dst: int
    kind: OpKind = OpKind.SWAP


@dataclass(frozen=True, order=True)
class Drop:
    """Remove the replica of `expert` on rank `src`, freeing its slot; the expert keeps its other replicas."""

    layer: int
    expert: int
    src: int
    kind: OpKind = OpKind.DROP


Operation = Replicate | Consolidate | Migrate | Drain | Restore | Repair | Swap | Drop


def describe(op: Operation) -> str:
    """One human line, e.g. 'replicate L3 E17 -> r5'."""
    if isinstance(op, Replicate):
        return f"replicate L{op.layer} E{op.expert} -> r{op.dst}"
    if isinstance(op, Consolidate):
        return f"consolidate L{op.layer} E{list(op.experts)} -> r{op.dst}"
    if isinstance(op, Migrate):
        return f"migrate L{op.layer} E{op.expert} r{op.src} -> r{op.dst}"
    if isinstance(op, Drain):
        return f"drain r{op.rank}"
    if isinstance(op, Restore):
        return f"restore r{op.rank}"
    if isinstance(op, Swap):
        return f"swap L{op.layer} E{op.expert}@r{op.src} <-> E{op.other}@r{op.dst}"
    if isinstance(op, Drop):
        return f"drop L{op.layer} E{op.expert} r{op.src}"
    src = "host" if op.source < 0 else f"r{op.source}"
    return f"repair L{op.layer} E{op.expert} {src} -> r{op.dst}"


class _Work:
    """Mutable scratch copy of a table's placement while a list of operations is applied. A layer the
    operations touch is worked on as Python lists (an operation touches a few slots: list scans beat numpy
    calls at that size) and written back once, at the end."""

    def __init__(self, table: RoutingTable) -> None:
        self.t = table
        self.S = table.topology.slots_per_rank
        self.G = table.topology.ranks
        self.phy = np.array(table.phy2log, dtype=np.int64).reshape(table.layers, self.G, self.S)
        self._rows: dict[int, list[list[int]]] = {}
        self.active = set(table.active_ranks)

    def rows(self, layer: int) -> list[list[int]]:
        """The slots of `layer`, rank by rank (a list per rank), taken from the array on first touch."""
        r = self._rows.get(layer)
        if r is None:
            r = self._rows[layer] = self.phy[layer].tolist()
        return r

    def clear_rank(self, rank: int) -> None:
        self.phy[:, rank, :] = -1
        for r in self._rows.values():
            r[rank] = [-1] * self.S

    def result(self) -> I64:
        for lay, r in self._rows.items():
            self.phy[lay] = r
        out: I64 = self.phy.reshape(self.t.layers, self.G * self.S)
        return out

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.t.layers:
            raise InvalidOperation(InvalidReason.UNKNOWN_LAYER, f"layer {layer} not in 0..{self.t.layers - 1}")

    def check_expert(self, expert: int) -> None:
        if not 0 <= expert < self.t.experts:
            raise InvalidOperation(InvalidReason.UNKNOWN_EXPERT, f"expert {expert} not in 0..{self.t.experts - 1}")

    def check_rank(self, rank: int, *, active: bool = True) -> None:
        if not 0 <= rank < self.G:
            raise InvalidOperation(InvalidReason.UNKNOWN_RANK, f"rank {rank} not in 0..{self.G - 1}")
        if active and rank not in self.active:
            raise InvalidOperation(InvalidReason.RANK_INACTIVE, f"rank {rank} is not active")

    def place(self, layer: int, expert: int, dst: int) -> None:
        row = self.rows(layer)[dst]
        if expert in row:
            raise InvalidOperation(InvalidReason.ALREADY_ON_RANK, f"layer {layer} expert {expert} already on rank {dst}")
        if -1 not in row:
            raise InvalidOperation(InvalidReason.NO_FREE_SLOT, f"layer {layer} rank {dst} has no free slot")
        row[row.index(-1)] = expert

    def remove(self, layer: int, expert: int, src: int) -> None:
        row = self.rows(layer)[src]
        if expert not in row:
            raise InvalidOperation(InvalidReason.NOT_ON_RANK, f"layer {layer} expert {expert} is not on rank {src}")
        row[row.index(expert)] = -1


def apply_ops(table: RoutingTable, ops: list[Operation] | tuple[Operation, ...]) -> RoutingTable:
    """Apply `ops` in order to `table`; returns the successor (version + 1, parent = table.version)."""
    w = _Work(table)
    for op in ops:
        _apply_one(w, op)
    return table.successor(w.result(), tuple(sorted(w.active)))


def _apply_one(w: _Work, op: Operation) -> None:
    if isinstance(op, (Replicate, Repair)):
        w.check_layer(op.layer)
        w.check_expert(op.expert)
        w.check_rank(op.dst)
        if isinstance(op, Repair) and op.source >= 0:
            w.check_rank(op.source, active=False)
        w.place(op.layer, op.expert, op.dst)
    elif isinstance(op, Migrate):
        w.check_layer(op.layer)
        w.check_expert(op.expert)
        w.check_rank(op.src, active=False)
        w.check_rank(op.dst)
        w.remove(op.layer, op.expert, op.src)
        w.place(op.layer, op.expert, op.dst)
    elif isinstance(op, Consolidate):
        w.check_layer(op.layer)
        w.check_rank(op.dst)
        rows = w.rows(op.layer)
        keep = []
        for e in op.experts:
            w.check_expert(e)
            on_dst = e in rows[op.dst]  # a replica already on dst stays in its slot
            for g, r in enumerate(rows):
                if (g != op.dst or not on_dst) and e in r:
                    r[:] = [-1 if x == e else x for x in r]
            if not on_dst:
                keep.append(e)
        for e in keep:
            w.place(op.layer, e, op.dst)
    elif isinstance(op, Swap):
        w.check_layer(op.layer)
        for e in (op.expert, op.other):
            w.check_expert(e)
        w.check_rank(op.src)
        w.check_rank(op.dst)
        rows = w.rows(op.layer)
        a, b = rows[op.src], rows[op.dst]
        if op.src == op.dst or op.expert == op.other:
            raise InvalidOperation(InvalidReason.SAME_RANK, f"layer {op.layer}: a swap needs two ranks and two experts")
        if op.expert not in a or op.other not in b:
            missing = (op.expert, op.src) if op.expert not in a else (op.other, op.dst)
            raise InvalidOperation(InvalidReason.NOT_ON_RANK, f"layer {op.layer} expert {missing[0]} is not on rank {missing[1]}")
        if op.other in a or op.expert in b:
            raise InvalidOperation(InvalidReason.ALREADY_ON_RANK, f"layer {op.layer}: swapping E{op.expert} r{op.src} with "
                                                      f"E{op.other} r{op.dst} would put a second replica on a rank")
        a[a.index(op.expert)], b[b.index(op.other)] = op.other, op.expert
    elif isinstance(op, Drop):
        w.check_layer(op.layer)
        w.check_expert(op.expert)
        w.check_rank(op.src, active=False)
        if sum(r.count(op.expert) for r in w.rows(op.layer)) < 2:
            raise InvalidOperation(InvalidReason.LAST_REPLICA, f"layer {op.layer} expert {op.expert}: dropping its only replica")
        w.remove(op.layer, op.expert, op.src)
    elif isinstance(op, Drain):
        w.check_rank(op.rank)
        w.active.discard(op.rank)
        w.clear_rank(op.rank)
    elif isinstance(op, Restore):
        w.check_rank(op.rank, active=False)
        if op.rank in w.active:
            raise InvalidOperation(InvalidReason.RANK_ACTIVE, f"rank {op.rank} is already active")
        w.active.add(op.rank)
        w.clear_rank(op.rank)
    else:  # pragma: no cover - exhaustive over Operation
        raise InvalidOperation(InvalidReason.UNKNOWN_KIND, f"unknown operation {op!r}")


# ---- lifecycle: an operation (or the plan carrying it) from proposal to its end --------------------

class OpState(StrEnum):
    PROPOSED = "PROPOSED"
    COMMITTED = "COMMITTED"
    STAGING = "STAGING"  # new replicas' weights are being copied into free slots
    ACTIVE = "ACTIVE"  # the table that contains it is installed
    DONE = "DONE"
    ABORTED = "ABORTED"
    EXPIRED = "EXPIRED"
    ROLLED_BACK = "ROLLED_BACK"


class EndReason(StrEnum):
    """Typed reason of every end state (and of notable transitions)."""

    KEPT = "KEPT"  # observed for N windows and it helped
    PROPOSAL_FAILED = "PROPOSAL_FAILED"  # consensus refused or timed out
    LOST_TO_OTHER_PROPOSAL = "LOST_TO_OTHER_PROPOSAL"  # another table won the version
    SUPERSEDED = "SUPERSEDED"  # a newer table replaced it before it could be judged
    STAGING_FAILED = "STAGING_FAILED"
    REALISED_NOT_BETTER = "REALISED_NOT_BETTER"  # rolled back: replay of N windows showed no gain


TERMINAL = frozenset({OpState.DONE, OpState.ABORTED, OpState.EXPIRED, OpState.ROLLED_BACK})

# Allowed transitions. COMMITTED -> ACTIVE directly when nothing needs staging or staging is not
# observed (the controller sees commits and installs, the shim sees staging).
TRANSITIONS: dict[OpState, frozenset[OpState]] = {
    OpState.PROPOSED: frozenset({OpState.COMMITTED, OpState.ABORTED, OpState.EXPIRED}),
    OpState.COMMITTED: frozenset({OpState.STAGING, OpState.ACTIVE, OpState.ABORTED, OpState.EXPIRED}),
    OpState.STAGING: frozenset({OpState.ACTIVE, OpState.ABORTED}),
    OpState.ACTIVE: frozenset({OpState.DONE, OpState.ROLLED_BACK, OpState.EXPIRED}),
}


@dataclass(frozen=True)
class Lifecycle:
    """State of one operation or plan; `reason` is an EndReason for end states, "" otherwise."""

    state: OpState = OpState.PROPOSED
    reason: str = ""

    def to(self, state: OpState, reason: str = "") -> Lifecycle:
        """The next state; raises InvalidOperation(BAD_TRANSITION) if the table does not allow it."""
        if state not in TRANSITIONS.get(self.state, frozenset()):
            raise InvalidOperation(InvalidReason.BAD_TRANSITION, f"{self.state} -> {state} is not allowed")
        if state in TERMINAL and not reason:
            raise InvalidOperation(InvalidReason.BAD_TRANSITION, f"{self.state} -> {state} needs a reason")
        return Lifecycle(state, reason)

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL
