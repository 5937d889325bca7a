"""CRAFT: cost-aware expert replica allocation with layer-wise replication benefit.

From the published description: (1) per layer, estimate the benefit of 1, 2, 4, ... extra replicas by
replaying recorded routing against the placement each would give; (2) choose how many replicas each layer
gets with a multiple-choice knapsack, solved by dynamic programming over layers, within a replica budget
(by default every free slot); (3) capacity-aware placement: the static placement's experts stay where
they are and each replica goes to the least-loaded rank that still has a free slot and does not hold
that expert. The benefit of an option is the reduction of the layer's summed per-step max rank load
(the quantity a layer's latency follows), against the same layer with no replica.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from controlplane.baselines.eplb import replicate_experts
from controlplane.errors import InvalidShape
from controlplane.load import rank_load
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def replica_options(max_extra: int) -> I64:
    """[K] extra-replica counts tried per layer: 0, 1, 2, 4, ... up to `max_extra` (which is included)."""
    opts = [0]
    k = 1
    while k < max_extra:
        opts.append(k)
        k *= 2
    if max_extra > 0:
        opts.append(max_extra)
    return np.array(opts, dtype=np.int64)


def mckp(values: F64, costs: I64, budget: int) -> I64:
    """Multiple-choice knapsack: one option per row, total cost <= budget, maximum total value.

    values: [L, K]; costs: [K] or [L, K] non-negative ints -> choice [L] (option index per row).
    Dynamic programming over rows with a [budget + 1] table, vectorised over budgets; on equal value the
    lower option index wins. Raises InvalidShape when no choice fits (every row's cheapest option
    together exceeds the budget).
    """
    v = np.asarray(values, dtype=np.float64)
    L, K = v.shape
    c = np.broadcast_to(np.asarray(costs, dtype=np.int64), (L, K))
    if (c < 0).any() or budget < 0:
        raise InvalidShape(f"mckp: negative cost or budget {budget}")
    B = budget + 1
    neg = -np.inf
    dp = np.full(B, neg)
    dp[0] = 0.0
    pick = np.zeros((L, B), dtype=np.int64)
    for layer in range(L):  # rows; each vectorised over the budget axis
        best = np.full(B, neg)
        arg = np.zeros(B, dtype=np.int64)
        for k in range(K):
            ck = int(c[layer, k])
            if ck >= B:
                continue
            cand = np.full(B, neg)
            cand[ck:] = dp[: B - ck] + v[layer, k]
            better = cand > best
            best = np.where(better, cand, best)
            arg = np.where(better, k, arg)
        dp = best
        pick[layer] = arg
    if not np.isfinite(dp).any():
        raise InvalidShape(f"mckp: no choice fits budget {budget}")
    b = int(np.argmax(dp))  # first budget reaching the optimum: the cheapest optimal plan
    choice = np.zeros(L, dtype=np.int64)
    for layer in range(L - 1, -1, -1):
        k = int(pick[layer, b])
        choice[layer] = k
        b -= int(c[layer, k])
    return choice


def place_replicas(base: RoutingTable, totals: F64, extra: I64) -> I64:
    """Capacity-aware placement of `extra [L]` replicas per layer on top of `base`'s slots.

    totals: [L, E] load per expert -> phy2log [L, P]. Which experts get replicas: DeepSeek's greedy
    replicate_experts over E + extra[l] physical experts; each replica, in that order, goes to the rank
    with the least estimated load (even split over replicas) that has a free slot and lacks the expert.
    A replica with no such rank is skipped. Loops over replica index, vectorised over layers.
    """
    topo = base.topology
    L, E, G, S = base.layers, base.experts, topo.ranks, topo.slots_per_rank
    phy = np.array(base.phy2log, dtype=np.int64).reshape(L, G, S)
    free0 = (phy < 0).sum(axis=2)  # [L, G]
    extra = np.minimum(extra, E * (G - 1))  # an expert has at most one replica per rank
    max_extra = int(extra.max(initial=0))
    if max_extra == 0:
        return phy.reshape(L, G * S)
    adds, _ = replicate_experts(totals, E + max_extra, max_replicas=G)
    adds = adds[:, E:]  # [L, max_extra] expert of each added replica, in greedy order
    holds = np.zeros((L, G, E), dtype=bool)
    li, gi, si = np.nonzero(phy >= 0)
    holds[li, gi, phy[li, gi, si]] = True
    orig = holds.copy()
    free = free0.copy()
    rows = np.arange(L)
    for i in range(max_extra):
        live = i < extra
        e = adds[:, i]
        cnt = holds.sum(axis=1)  # [L, E]
        share = totals / np.maximum(cnt, 1)
        load = np.einsum("lge,le->lg", holds, share)
        ok = (free > 0) & ~holds[rows, :, e]
        score = np.where(ok, load, np.inf)
        dst = np.argmin(score, axis=1)
        place = live & ok[rows, dst]
        lp = rows[place]
        holds[lp, dst[place], e[place]] = True
        free[lp, dst[place]] -= 1
    # write the new replicas into free slots (lowest free slot first)
    lq, gq, eq = np.nonzero(holds & ~orig)
    for layer, g, ex in zip(lq.tolist(), gq.tolist(), eq.tolist(), strict=True):  # one per added replica
        slot = int(np.flatnonzero(phy[layer, g] < 0)[0])
        phy[layer, g, slot] = ex
    return phy.reshape(L, G * S)


def layer_max_load(table_phy: I64, base: RoutingTable, steps: npt.NDArray[np.integer], chunk: int = 256) -> F64:
    """Sum over steps of each layer's max rank load. steps: [T, L, E] -> [L]."""
    t = base.successor(table_phy)
    out = np.zeros(base.layers, dtype=np.float64)
    for a in range(0, steps.shape[0], chunk):
        out += rank_load(t, steps[a:a + chunk]).max(axis=-1).sum(axis=0)
    return out


def craft_table(base: RoutingTable, steps: npt.NDArray[np.integer], budget: int | None = None) -> RoutingTable:
    """Plan CRAFT from a replay buffer `steps [T, L, E]` on top of `base` (the static placement).

    budget: total extra replica slots over all layers (default: every free slot of `base`).
    Returns the successor of `base` with the chosen replicas placed.
    """
    s = np.asarray(steps)
    if s.ndim != 3 or s.shape[1:] != (base.layers, base.experts):
        raise InvalidShape(f"steps shape {s.shape}: expected [T, {base.layers}, {base.experts}]")
    free_per_layer = int((base.phy2log < 0).sum(axis=1).min())
    b = free_per_layer * base.layers if budget is None else int(budget)
    opts = replica_options(free_per_layer)
    totals = s.sum(axis=0, dtype=np.int64).astype(np.float64)
    placements = [place_replicas(base, totals, np.full(base.layers, int(r), dtype=np.int64)) for r in opts]
    maxload = np.stack([layer_max_load(p, base, s) for p in placements], axis=1)  # [L, K]
    benefit = maxload[:, :1] - maxload
    choice = mckp(benefit, opts, b)
    phy = np.stack([placements[int(k)][layer] for layer, k in enumerate(choice.tolist())])
    table = base.successor(phy)
    table.validate()
    return table
