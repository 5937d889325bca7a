"""Large-gap planning: re-pack a layer toward EPLB's balance while keeping what already sits well.

The greedy planner (controlplane.greedy) moves one expert off a layer's hottest rank per round: cheap in
bytes, and right for small drift. After a large drift it stops in a local optimum well above what a full
re-pack reaches (DeepSeek-V3 decode after a workload shift: greedy settles ~0.10 above EPLB's mean step
imbalance). This module proposes the larger deltas:

1. replica counts per expert as EPLB computes them (`replicate_experts` over the active slots: the next
   replica goes to the expert with the largest load per replica), at most one replica per active rank;
2. a *sticky* longest-processing-time packing: replicas heaviest first, each to the least-loaded active rank
   with room that does not hold the expert yet, except that a rank which already holds the expert is
   preferred when its load is within `alpha` x the layer's mean rank load of the least-loaded one. alpha = 0
   is EPLB's own greedy packing (every slot may move); larger alphas keep more replicas where they are;
3. slots preserved per rank (vLLM's preserve_intragpu_slots), so an expert that stays on a rank keeps its slot.

`candidates` returns one table per alpha; the caller (decision.rebalance) takes, per layer, whichever of
head / greedy / these pays best under the planner's rule (each moved slot must pay `min_op_gain` of its
layer's objective on the replay blocks), and replays the result step by step before proposing it.
Vectorised over layers; loops over the P active slots of a layer (320 at DeepSeek-V3 8x8x5).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.baselines.eplb import preserve_slots, replicate_experts
from controlplane.load import rank_load
from controlplane.ops import Drop, Migrate, Operation, Replicate, Swap
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

ALPHAS = (0.0, 0.01, 0.03, 0.06, 0.1)  # stickiness levels tried, in units of the layer's mean rank load


def sticky_pack(head: RoutingTable, weight: F64, alpha: float) -> tuple[I64, npt.NDArray[np.bool_]]:
    """phy2log [L, P] re-packed from `weight` [L, E] (token totals), and ok [L]: False for a layer whose
    packing ran out of room (its row is head's)."""
    topo = head.topology
    G, S, L, E = topo.ranks, topo.slots_per_rank, head.layers, head.experts
    act = head.active_mask
    A = int(act.sum())
    w = np.asarray(weight, dtype=np.float64) + 1e-9  # cold experts still order deterministically
    _, cnt = replicate_experts(w, A * S, max_replicas=A)  # [L, E]
    n_items = A * S
    item_e = np.stack([np.repeat(np.arange(E), cnt[layer]) for layer in range(L)])  # [L, n_items]
    item_w = np.take_along_axis(w / cnt, item_e, axis=1)
    order = np.argsort(-item_w, axis=1, kind="stable")
    item_e = np.take_along_axis(item_e, order, axis=1)
    item_w = np.take_along_axis(item_w, order, axis=1)
    holds = head.holders
    rows = np.arange(L)
    slack = alpha * w.sum(axis=1) / A  # [L]
    load = np.zeros((L, G))
    n = np.where(act, 0, S)[None, :].repeat(L, axis=0)
    has = np.zeros((L, E, G), dtype=bool)
    ok = np.ones(L, dtype=bool)
    for j in range(n_items):
        e = item_e[:, j]
        elig = (n < S) & ~has[rows, e, :]  # [L, G]
        lo = np.where(elig, load, np.inf)
        gmin = np.argmin(lo, axis=1)
        pref = np.where(elig & holds[rows, e, :], load, np.inf)
        gpref = np.argmin(pref, axis=1)
        use = pref[rows, gpref] <= lo[rows, gmin] + slack
        g = np.where(use, gpref, gmin)
        stuck = ~elig.any(axis=1)
        ok &= ~stuck
        live = ~stuck
        r, gg = rows[live], g[live]
        load[r, gg] += item_w[live, j]
        n[r, gg] += 1
        has[r, e[live], gg] = True
    # experts per rank -> [L, G, S] (held experts first, -1 after), then keep each kept expert's slot
    per = has.transpose(0, 2, 1)  # [L, G, E]
    first = np.argsort(~per, axis=2, kind="stable")[:, :, :S]
    held = np.take_along_axis(per, first, axis=2)
    new = np.where(held, first, -1).reshape(L, G * S)
    new = preserve_slots(new, head.phy2log, G)
    new[~ok] = head.phy2log[~ok]
    return new, ok


def layer_objective(table: RoutingTable, X: npt.NDArray[np.integer]) -> I64:
    """[L]: sum over blocks of the max active rank load (the greedy planner's objective). X [nb, L, E]."""
    loads = rank_load(table, X)[..., table.active_mask]  # [nb, L, A]
    out: I64 = loads.max(axis=-1).sum(axis=0)
    return out


def candidates(head: RoutingTable, X: npt.NDArray[np.integer],
               alphas: tuple[float, ...] = ALPHAS) -> list[RoutingTable]:
    """One re-packed successor of `head` per alpha, fitted on the replay blocks' totals."""
    w = np.asarray(X, dtype=np.int64).sum(axis=0).astype(np.float64)
    return [head.successor(sticky_pack(head, w, a)[0]) for a in alphas]


def moved_slots(a: RoutingTable, b: RoutingTable) -> I64:
    """[L]: slots of `b` whose expert differs from `a`'s and is not empty (copies to make)."""
    out: I64 = ((a.phy2log != b.phy2log) & (b.phy2log >= 0)).sum(axis=1)
    return out


def ops_to(head: RoutingTable, target: RoutingTable, layers: list[int]) -> list[Operation] | None:
    """Operations that give `head` the experts `target` has on every rank, in the given layers: drops (an
    expert losing replicas), then migrations and replications into free slots, and a swap wherever full
    ranks wait on each other. Applying them to head gives target's rank sets; experts that stay keep their
    slots. None if some layer cannot be expressed (not seen in practice; the layer is then left out)."""
    G, S = head.topology.ranks, head.topology.slots_per_rank
    out: list[Operation] = []
    for lay in layers:
        have = [set(r[r >= 0].tolist()) for r in head.phy2log[lay].reshape(G, S)]
        want = [set(r[r >= 0].tolist()) for r in target.phy2log[lay].reshape(G, S)]
        free = [S - len(h) for h in have]
        leave: dict[int, list[int]] = {}
        arrive: dict[int, list[int]] = {}
        for g in range(G):
            for e in sorted(have[g] - want[g]):
                leave.setdefault(e, []).append(g)
            for e in sorted(want[g] - have[g]):
                arrive.setdefault(e, []).append(g)
        moves: list[list[int]] = []  # [expert, src, dst]
        reps: list[tuple[int, int]] = []
        for e in sorted(set(leave) | set(arrive)):
            lv, ar = leave.get(e, []), arrive.get(e, [])
            for src, dst in zip(lv, ar, strict=False):
                moves.append([e, src, dst])
            for src in lv[len(ar):]:
                out.append(Drop(lay, e, src))
                have[src].discard(e)
                free[src] += 1
            reps += [(e, dst) for dst in ar[len(lv):]]
        while moves or reps:
            progress = False
            for m in list(moves):
                e, src, dst = m
                if free[dst] > 0:
                    out.append(Migrate(lay, e, src, dst))
                    have[src].discard(e)
                    have[dst].add(e)
                    free[src] += 1
                    free[dst] -= 1
                    moves.remove(m)
                    progress = True
            for r in list(reps):
                e, dst = r
                if free[dst] > 0:
                    out.append(Replicate(lay, e, dst))
                    have[dst].add(e)
                    free[dst] -= 1
                    reps.remove(r)
                    progress = True
            if progress:
                continue
            if not moves:
                return None
            # full ranks wait on each other: swap a waiting move with a move out of its destination
            pair = next(((m1, m2) for m1 in moves for m2 in moves
                         if m2 is not m1 and m2[1] == m1[2] and m2[0] not in have[m1[1]]
                         and m1[0] not in have[m1[2]]), None)
            if pair is None:
                return None
            (e1, h1, g1), m2 = pair
            e2, _, x = m2
            out.append(Swap(lay, e1, h1, e2, g1))
            have[h1].discard(e1)
            have[h1].add(e2)
            have[g1].discard(e2)
            have[g1].add(e1)
            moves.remove(pair[0])
            if x == h1:
                moves.remove(m2)
            else:
                m2[1] = h1
    return out
