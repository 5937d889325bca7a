"""Elastic ranks: plans for draining a rank, repairing after rank loss, and restoring a rank.

Each returns the operations to commit atomically as one new table version, or raises DrainRefused with
the numbers an operator needs (experts, replicas required, free slots).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.errors import ControlPlaneError
from controlplane.load import rank_load
from controlplane.ops import Consolidate, Drain, Migrate, Operation, Repair, Restore, apply_ops
from controlplane.table import RoutingTable


class DrainRefused(ControlPlaneError):
    code = "DRAIN_REFUSED"


def _rank_loads(table: RoutingTable, load: npt.NDArray[np.integer] | None) -> npt.NDArray[np.int64]:
    """[L, G] load per rank under `table` (zeros without a load view)."""
    if load is None:
        return np.zeros((table.layers, table.topology.ranks), dtype=np.int64)
    return rank_load(table, np.asarray(load, dtype=np.int64))


def _rehome(
    table: RoutingTable,
    lone: list[tuple[int, int, int]],
    leaving: set[int],
    load: npt.NDArray[np.integer] | None,
    copy_from_host: bool,
) -> list[Operation]:
    """Place each (layer, expert, old_rank) on a surviving active rank with a free slot: same node as the
    old rank first, then the least-loaded rank, ties by rank id. Raises DrainRefused when a layer lacks room."""
    topo = table.topology
    S = topo.slots_per_rank
    G = topo.ranks
    phy = table.phy2log.reshape(table.layers, G, S)
    free = (phy < 0).sum(axis=2).astype(np.int64)  # [L, G]
    survivors = [g for g in table.active_ranks if g not in leaving]
    rl = _rank_loads(table, load)
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for layer, expert, old in lone:
        by_layer.setdefault(layer, []).append((expert, old))
    ops: list[Operation] = []
    expert_load = None if load is None else np.asarray(load, dtype=np.int64)
    node = [topo.node_of(g) for g in range(G)]
    # Plain lists per layer: one numpy call per candidate rank costs more than the work, and a long run of tiny
    # numpy calls on the planner's thread keeps the agent's event loop from the GIL (agent.decision.offloop).
    for layer in sorted(by_layer):
        need = by_layer[layer]
        room = int(free[layer, survivors].sum())
        if len(need) > room:
            raise DrainRefused(
                f"layer {layer}: {len(need)} experts have their only replica on rank(s) {sorted(leaving)} "
                f"(replicas required: {len(need)}), but the {len(survivors)} remaining active ranks have only "
                f"{room} free slots; {table.experts} experts need at least {-(-table.experts // S)} ranks of "
                f"{S} slots"
            )
        # hottest experts first so they land on the coolest ranks
        el = expert_load[layer].tolist() if expert_load is not None else [0] * table.experts
        order = sorted(need, key=lambda eo: (-el[eo[0]], eo[0]))
        rows, fr, ld = phy[layer].tolist(), free[layer].tolist(), rl[layer].tolist()
        for expert, old in order:
            cands = [g for g in survivors if fr[g] > 0 and expert not in rows[g]]
            if not cands:
                raise DrainRefused(f"layer {layer}: no surviving rank has a free slot for expert {expert}")
            old_node = node[old]
            dst = min(cands, key=lambda g: (node[g] != old_node, ld[g], g))
            fr[dst] -= 1
            ld[dst] += el[expert]
            ops.append(Repair(layer, expert, dst, -1) if copy_from_host else Migrate(layer, expert, old, dst))
    return ops


def _make_room(
    table: RoutingTable, lone: list[tuple[int, int, int]], leaving: set[int], load: npt.NDArray[np.integer] | None
) -> list[Operation]:
    """Free survivor slots where a layer has more lone experts than free slots: drop the extra replicas of
    the coldest replicated experts (Consolidate onto one surviving replica: no bytes copied). Lone experts
    need a home more than hot experts need a second copy."""
    topo = table.topology
    S, G = topo.slots_per_rank, topo.ranks
    phy = table.phy2log.reshape(table.layers, G, S)
    survivors = np.array([g for g in table.active_ranks if g not in leaving], dtype=np.int64)
    need = np.bincount([lay for lay, _, _ in lone], minlength=table.layers)
    room = (phy[:, survivors] < 0).sum(axis=(1, 2))
    ops: list[Operation] = []
    for layer in np.flatnonzero(need > room).tolist():
        deficit = int(need[layer] - room[layer])
        held = phy[layer, survivors]  # [survivors, S]
        cnt = np.bincount(held[held >= 0], minlength=table.experts)
        extra = np.flatnonzero(cnt >= 2)
        per_replica = (np.zeros(extra.size) if load is None
                       else np.asarray(load, dtype=np.float64)[layer, extra] / cnt[extra])
        for e in extra[np.lexsort((extra, per_replica))].tolist():  # coldest per replica first, ties by id
            if deficit <= 0:
                break
            keep = int(survivors[np.flatnonzero((held == e).any(axis=1))[0]])
            ops.append(Consolidate(layer, (e,), keep))
            deficit -= int(cnt[e]) - 1
    return ops


def _lone_replicas(table: RoutingTable, ranks: set[int]) -> list[tuple[int, int, int]]:
    """(layer, expert, rank) for experts whose every replica sits on `ranks`."""
    S = table.topology.slots_per_rank
    phy = table.phy2log
    out: list[tuple[int, int, int]] = []
    slot_rank = np.arange(table.slots) // S
    on = np.isin(slot_rank, sorted(ranks))
    outside = np.zeros((table.layers, table.experts), dtype=np.int64)
    rows, cols = np.nonzero((phy >= 0) & ~on[None, :])
    np.add.at(outside, (rows, phy[rows, cols]), 1)
    rows, cols = np.nonzero((phy >= 0) & on[None, :])
    for layer, slot in zip(rows.tolist(), cols.tolist(), strict=True):
        e = int(phy[layer, slot])
        if outside[layer, e] == 0:
            out.append((layer, e, int(slot_rank[slot])))
            outside[layer, e] = -1  # once per expert, even if it has several slots on the leaving ranks
    return out


def plan_drain(table: RoutingTable, rank: int, load: npt.NDArray[np.integer] | None = None) -> tuple[Operation, ...]:
    """Move the lone replicas off `rank` (copied from it, nearest first), then take it out of service."""
    if rank not in table.active_ranks:
        raise DrainRefused(f"rank {rank} is not active (active: {len(table.active_ranks)} ranks)")
    if len(table.active_ranks) == 1:
        raise DrainRefused(f"rank {rank} is the last active rank")
    lone = _lone_replicas(table, {rank})
    room = _make_room(table, lone, {rank}, load)
    base = apply_ops(table, room) if room else table
    ops = _rehome(base, lone, {rank}, load, copy_from_host=False)
    return (*room, *ops, Drain(rank))


def plan_repair(
    table: RoutingTable, dead: set[int], load: npt.NDArray[np.integer] | None = None
) -> tuple[Operation, ...]:
    """After rank loss: dead ranks leave the active set; each expert left without a replica is reloaded
    from the host tier onto a surviving rank (its weights are gone with the dead rank)."""
    dead = {g for g in dead if g in table.active_ranks}
    if not dead:
        return ()
    if len(dead) >= len(table.active_ranks):
        raise DrainRefused(f"all {len(table.active_ranks)} active ranks are dead: nothing to repair onto")
    lone = _lone_replicas(table, dead)
    room = _make_room(table, lone, dead, load)
    base = apply_ops(table, room) if room else table
    ops = _rehome(base, lone, dead, load, copy_from_host=True)
    return (*(Drain(g) for g in sorted(dead)), *room, *ops)


def plan_restore(table: RoutingTable, rank: int) -> tuple[Operation, ...]:
    """Return `rank` to service with empty slots; the controller that proposed it then proposes experts for the
    rank as it commits (controlplane.restore.fill)."""
    if not 0 <= rank < table.topology.ranks:
        raise DrainRefused(f"rank {rank}: expected 0..{table.topology.ranks - 1}")
    if rank in table.active_ranks:
        raise DrainRefused(f"rank {rank} is already active")
    return (Restore(rank),)
