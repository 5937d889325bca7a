"""Versioned routing tables: `phy2log [L, P]` and what derives from it.

Conventions follow DeepSeek EPLB / vLLM / SGLang: `phy2log[l, p]` is the logical expert held by physical
slot `p` of layer `l` (-1 = empty); `log2phy [L, E, R]` lists each expert's slots in ascending order, -1
padded; `logcnt [L, E]` counts them. Slot p lives on rank p // S.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from controlplane.errors import InvalidShape, InvalidTable
from controlplane.topology import Tier, Topology

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class RoutingTable:
    """One committed (or proposed) placement of every layer's experts onto slots.

    phy2log: int64 [L, P]; experts: E; active_ranks: sorted rank ids that may receive tokens.
    Slots of inactive ranks must be empty. Frozen: operations produce new tables. parent_hash: the parent
    table's digest (empty for a genesis table), so that a table's digest commits to its whole history: two
    nodes at one version with different parents hold different digests, and an acceptor refuses a proposal
    built on a parent other than its own head.
    """

    topology: Topology
    experts: int
    phy2log: I64
    version: int = 0
    parent: int = 0
    active_ranks: tuple[int, ...] = field(default=())
    parent_hash: bytes = b""

    def __post_init__(self) -> None:
        arr = np.ascontiguousarray(self.phy2log, dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != self.topology.slots:
            raise InvalidShape(f"phy2log shape {arr.shape}: expected [layers, {self.topology.slots}]")
        arr.setflags(write=False)
        object.__setattr__(self, "phy2log", arr)
        if not self.active_ranks:
            object.__setattr__(self, "active_ranks", tuple(range(self.topology.ranks)))
        else:
            object.__setattr__(self, "active_ranks", tuple(sorted(set(int(r) for r in self.active_ranks))))

    # ---- shape -------------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def slots(self) -> int:
        return int(self.phy2log.shape[1])

    @cached_property
    def active_mask(self) -> npt.NDArray[np.bool_]:
        """[G] True for ranks that may receive tokens."""
        mask = np.zeros(self.topology.ranks, dtype=bool)
        mask[list(self.active_ranks)] = True
        return mask

    # ---- derived views -----------------------------------------------------------------------
    @cached_property
    def holders(self) -> npt.NDArray[np.bool_]:
        """[L, E, G] read-only: rank g holds a replica of expert e in layer l."""
        G, S = self.topology.ranks, self.topology.slots_per_rank
        out = np.zeros((self.layers, self.experts, G), dtype=bool)
        rows, cols = np.nonzero(self.phy2log >= 0)
        out[rows, self.phy2log[rows, cols], cols // S] = True
        out.setflags(write=False)
        return out

    @cached_property
    def logcnt(self) -> I64:
        """[L, E] number of replicas of each logical expert."""
        out = np.zeros((self.layers, self.experts), dtype=np.int64)
        rows, cols = np.nonzero(self.phy2log >= 0)
        np.add.at(out, (rows, self.phy2log[rows, cols]), 1)
        out.setflags(write=False)
        return out

    @cached_property
    def log2phy(self) -> I64:
        """[L, E, R] slots of each expert in ascending order, -1 padded; R = max replica count (>= 1)."""
        r = max(1, int(self.logcnt.max(initial=0)))
        out = np.full((self.layers, self.experts, r), -1, dtype=np.int64)
        rows, cols = np.nonzero(self.phy2log >= 0)  # row-major: slots ascending within a layer
        exp = self.phy2log[rows, cols]
        j = self.replica_index[rows, cols]
        out[rows, exp, j] = cols
        out.setflags(write=False)
        return out

    @cached_property
    def replica_index(self) -> I64:
        """[L, P] index of each slot among its expert's replicas (ascending slot order); -1 for empty."""
        out = layer_views(self.phy2log, self.experts)[1]
        out.setflags(write=False)
        return out

    @cached_property
    def digest(self) -> bytes:
        """sha256 over version, parent, shape, active ranks, phy2log (little-endian) and, when there is one, the
        parent's digest (after phy2log, whose length the header fixes)."""
        h = hashlib.sha256()
        header = np.array(
            [self.version, self.parent, self.layers, self.slots, self.experts, self.topology.slots_per_rank],
            dtype="<i8",
        )
        h.update(header.tobytes())
        h.update(np.asarray(self.active_ranks, dtype="<i8").tobytes())
        h.update(b"|")
        h.update(self.phy2log.astype("<i8", copy=False).tobytes())
        if self.parent_hash:
            h.update(b"^" + self.parent_hash)
        return h.digest()

    @cached_property
    def content_digest(self) -> bytes:
        """sha256 over what determines loads: active ranks and phy2log (not version or parent)."""
        h = hashlib.sha256(np.asarray(self.active_ranks, dtype="<i8").tobytes())
        h.update(b"|")
        h.update(self.phy2log.astype("<i8", copy=False).tobytes())
        return h.digest()

    def content_equal(self, other: RoutingTable) -> bool:
        return (
            self.experts == other.experts
            and self.active_ranks == other.active_ranks
            and self.phy2log.shape == other.phy2log.shape
            and bool(np.array_equal(self.phy2log, other.phy2log))
        )

    # ---- constructors ------------------------------------------------------------------------
    def successor(self, phy2log: I64, active_ranks: tuple[int, ...] | None = None) -> RoutingTable:
        """A table for version + 1 whose parent is this one."""
        return RoutingTable(
            topology=self.topology,
            experts=self.experts,
            phy2log=phy2log,
            version=self.version + 1,
            parent=self.version,
            active_ranks=self.active_ranks if active_ranks is None else active_ranks,
            parent_hash=self.digest,
        )

    def with_version(self, version: int, parent: int, parent_hash: bytes = b"") -> RoutingTable:
        return RoutingTable(self.topology, self.experts, self.phy2log, version, parent, self.active_ranks,
                            parent_hash)

    # ---- validation --------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise InvalidTable naming the first layer/expert/rank that breaks the design's "valid table"."""
        validate_phy2log(self.phy2log, self.experts, self.topology, self.active_mask)

    def is_valid(self) -> bool:
        try:
            self.validate()
        except InvalidTable:
            return False
        return True


def rank_duplicates(phy2log: I64, topo: Topology) -> npt.NDArray[np.int64]:
    """[L, G] number of slots of each rank that repeat an expert the rank already holds in that layer."""
    L = phy2log.shape[0]
    srt = np.sort(phy2log.reshape(L, topo.ranks, topo.slots_per_rank), axis=2)
    dup = (srt[:, :, 1:] == srt[:, :, :-1]) & (srt[:, :, 1:] >= 0)
    out: npt.NDArray[np.int64] = dup.sum(axis=2).astype(np.int64)
    return out


def check_no_new_rank_duplicates(head: RoutingTable, table: RoutingTable) -> None:
    """The planner's rule (stricter than a valid table): no (layer, rank) of `table` repeats an expert more
    often than `head` did. Imported tables may hold same-rank duplicates; plans never add any."""
    more = rank_duplicates(table.phy2log, table.topology) > rank_duplicates(head.phy2log, head.topology)
    if more.any():
        layer, rank = (int(x) for x in np.argwhere(more)[0])
        raise InvalidTable(f"layer {layer} rank {rank} holds two replicas of one expert: "
                           f"{table.phy2log.reshape(table.layers, table.topology.ranks, -1)[layer, rank].tolist()}")


def validate_phy2log(
    phy2log: I64, experts: int, topo: Topology, active_mask: npt.NDArray[np.bool_] | None = None
) -> None:
    """Check a [L, P] placement: ids in range, inactive ranks empty, every expert has a replica on an active
    rank. Two replicas of one expert on one rank are valid (DeepSeek EPLB and vLLM's boot placement produce
    them); the planner avoids them by its own rule (`check_no_new_rank_duplicates`). Vectorised; raises
    InvalidTable with the location."""
    L, P = phy2log.shape
    G, S = topo.ranks, topo.slots_per_rank
    if P != G * S:
        raise InvalidTable(f"phy2log has {P} slots per layer: expected ranks x slots_per_rank = {G * S}")
    bad = (phy2log < -1) | (phy2log >= experts)
    if bad.any():
        layer, slot = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidTable(
            f"layer {layer} slot {slot} holds expert {int(phy2log[layer, slot])}: expected -1..{experts - 1}"
        )
    mask = np.ones(G, dtype=bool) if active_mask is None else active_mask
    per_rank = phy2log.reshape(L, G, S)
    on_inactive = (per_rank >= 0) & ~mask[None, :, None]
    if on_inactive.any():
        layer, rank, _ = (int(x) for x in np.argwhere(on_inactive)[0])
        raise InvalidTable(f"layer {layer} rank {rank} is not active but holds experts {per_rank[layer, rank].tolist()}")
    cnt = np.zeros((L, experts), dtype=np.int64)
    rows, cols = np.nonzero(phy2log >= 0)
    np.add.at(cnt, (rows, phy2log[rows, cols]), 1)
    missing = cnt == 0
    if missing.any():
        layer, expert = (int(x) for x in np.argwhere(missing)[0])
        raise InvalidTable(f"layer {layer} expert {expert} has no replica on an active rank")


def initial_table(topo: Topology, layers: int, experts: int) -> RoutingTable:
    """Static EP placement, version 1: expert e on rank e * G // E (contiguous blocks), spare slots empty.

    Needs E <= G x S. Spare slots (G x S - E of them per layer) are what replicas use.
    """
    G, S = topo.ranks, topo.slots_per_rank
    if experts > G * S:
        raise InvalidTable(f"{experts} experts do not fit in {G} ranks x {S} slots = {G * S} slots")
    phy = np.full((layers, G, S), -1, dtype=np.int64)
    rank_of = (np.arange(experts) * G) // experts
    if np.bincount(rank_of, minlength=G).max() > S:
        rank_of = np.arange(experts) % G  # round-robin fallback when blocks would overflow a rank
    pos = np.zeros(G, dtype=np.int64)
    for e, g in enumerate(rank_of.tolist()):  # runs once per table build, E iterations
        phy[:, g, pos[g]] = e
        pos[g] += 1
    return RoutingTable(topo, experts, phy.reshape(layers, G * S), version=1, parent=0)


def table_from_bytes(
    topo: Topology,
    experts: int,
    layers: int,
    raw: bytes,
    version: int,
    parent: int,
    active_ranks: tuple[int, ...],
    parent_hash: bytes = b"",
) -> RoutingTable:
    """Decode packed little-endian int64 phy2log; raises InvalidShape on a size mismatch."""
    expected = layers * topo.slots * 8
    if len(raw) != expected:
        raise InvalidShape(f"phy2log has {len(raw)} bytes: expected {layers} x {topo.slots} x 8 = {expected}")
    arr = np.frombuffer(raw, dtype="<i8").astype(np.int64).reshape(layers, topo.slots)
    return RoutingTable(topo, experts, arr, version, parent, active_ranks, parent_hash)


# ---- diff: what a change of table moves ----------------------------------------------------------

@dataclass(frozen=True, order=True)
class WeightMove:
    """Slot `slot` (on rank `dst`) of layer `layer` receives expert `expert`, copied from rank `src`
    (-1: host memory) over `tier`; `nbytes` is the expert's weight size."""

    layer: int
    slot: int
    expert: int
    dst: int
    src: int
    tier: Tier
    nbytes: int


@dataclass(frozen=True)
class TableDiff:
    """Weight moves from table `a` to table `b`, and the slots `b` frees: (layer, slot, expert) whose
    content leaves; the shim releases them only once every peer runs `b`."""

    moves: tuple[WeightMove, ...]
    freed: tuple[tuple[int, int, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.moves)

    def bytes_by_tier(self) -> tuple[int, int, int, int]:
        out = [0, 0, 0, 0]
        for m in self.moves:
            out[int(m.tier)] += m.nbytes
        return (out[0], out[1], out[2], out[3])


def nearest_source(topo: Topology, holders: npt.ArrayLike, dst: int) -> tuple[int, Tier]:
    """The holder rank nearest to `dst` (same rank, same node, other node; ties to the lowest id), or
    (-1, HOST) when there is none."""
    hs = sorted(int(h) for h in np.asarray(holders).reshape(-1).tolist())
    if not hs:
        return -1, Tier.HOST
    best = min(hs, key=lambda h: (int(topo.tier(h, dst)), h))
    return best, topo.tier(best, dst)


def diff(a: RoutingTable, b: RoutingTable, expert_bytes: int = 0) -> TableDiff:
    """Moves that turn `a`'s placement into `b`'s (same shape). A slot of `b` whose expert differs from
    `a`'s gets a copy from the nearest rank that holds the expert in `a` and is active in `b` (a drained
    or lost rank cannot serve), else from host. Loops only over changed slots."""
    if a.phy2log.shape != b.phy2log.shape or a.experts != b.experts:
        raise InvalidShape(f"diff of tables shaped {a.phy2log.shape} and {b.phy2log.shape}")
    topo, S = a.topology, a.topology.slots_per_rank
    changed = a.phy2log != b.phy2log
    moves: list[WeightMove] = []
    b_active = b.active_mask
    for layer, slot in np.argwhere(changed & (b.phy2log >= 0)).tolist():
        e = int(b.phy2log[layer, slot])
        slots = a.log2phy[layer, e] if e < a.experts else np.zeros(0, dtype=np.int64)
        ranks = slots[slots >= 0] // S
        src, tier = nearest_source(topo, ranks[b_active[ranks]], slot // S)
        moves.append(WeightMove(int(layer), int(slot), e, int(slot // S), src, tier, int(expert_bytes)))
    freed = tuple(
        (int(layer), int(slot), int(a.phy2log[layer, slot]))
        for layer, slot in np.argwhere(changed & (a.phy2log >= 0)).tolist()
    )
    return TableDiff(tuple(moves), freed)


def copied_slots(a: npt.ArrayLike, b: npt.ArrayLike) -> int:
    """How many slots of phy2log `b` [L, P] receive an expert they did not hold in phy2log `a` [L, P]: the
    moves of `diff` between their tables, counted without building them (the weight bytes a change copies
    are this times the expert's size)."""
    pa, pb = np.asarray(a), np.asarray(b)
    if pa.shape != pb.shape:
        raise InvalidShape(f"diff of tables shaped {pa.shape} and {pb.shape}")
    return int(((pa != pb) & (pb >= 0)).sum())


def layer_views(phy: I64, experts: int) -> tuple[I64, I64]:
    """phy2log rows [n, P] -> (replica counts [n, E], replica index of each slot [n, P], -1 if empty),
    for every layer at once (RoutingTable.replica_index, and the replay's per-layer views)."""
    n, P = phy.shape
    valid = phy >= 0
    key = np.where(valid, phy, experts) + (np.arange(n) * (experts + 1))[:, None]
    cnt = np.bincount(key.reshape(-1), minlength=n * (experts + 1)).reshape(n, experts + 1)[:, :experts]
    order = np.argsort(key, axis=1, kind="stable")
    sk = np.take_along_axis(key, order, axis=1)
    pos = np.broadcast_to(np.arange(P), (n, P))
    start = np.ones((n, P), dtype=bool)
    start[:, 1:] = sk[:, 1:] != sk[:, :-1]
    first = np.maximum.accumulate(np.where(start, pos, 0), axis=1)
    j = np.empty((n, P), dtype=np.int64)
    np.put_along_axis(j, order, pos - first, axis=1)
    return cnt.astype(np.int64), np.where(valid, j, -1)
