"""CRAFT: cost-aware expert replica allocation with layer-wise replication benefit, as published.

(1) Per layer, the benefit of 0, 1, 2, 4, ... extra replicas: each option's placement is replayed against the
recorded routing; (2) how many replicas each layer gets: a multiple-choice knapsack over the layers, solved
by dynamic programming, within a replica budget (by default the same as EPLB's: every slot beyond one copy of
each expert); (3) placement, EPLB-like, of every expert: DeepSeek's greedy replication chooses which experts
the layer's replicas copy, and the layer's physical experts are packed heaviest first onto the least-loaded
rank with a free slot that does not hold that expert yet (a layer given fewer replicas leaves slots empty).
The benefit of an option is the reduction of the layer's summed per-step max rank load (the quantity a
layer's latency follows) against the same layer with no replica. With EPLB's budget, CRAFT gives every layer
as many replicas as EPLB; its gain is where the budget is smaller (the memory it saves), spent on the skewed
layers.
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


def pack_layers(base: RoutingTable, totals: F64, extra: I64) -> I64:
    """Every expert of every layer packed anew with `extra [L]` replicas per layer -> phy2log [L, P].

    totals: [L, E] load per expert. Which experts get the replicas: DeepSeek's greedy replicate_experts (the
    first E + extra[l] of its order). The layer's physical experts, heaviest (load / replicas) first, each go
    to the rank with the least load so far that has a free slot and lacks that expert (vectorised over
    layers). A replica with no such rank is dropped; every expert keeps its first copy (it comes first among
    its copies, and no rank holds it before it)."""
    topo = base.topology
    L, E, G, S = base.layers, base.experts, topo.ranks, topo.slots_per_rank
    extra = np.minimum(np.asarray(extra, dtype=np.int64), min(G * S - E, E * (G - 1)))
    n = E + int(extra.max(initial=0))
    order, _ = replicate_experts(totals, n, max_replicas=G)  # [L, n]: experts, then replicas in greedy order
    live = np.arange(n)[None, :] < (E + extra)[:, None]  # [L, n] the physical experts each layer has
    cnt = np.zeros((L, E), dtype=np.int64)
    rows = np.arange(L)
    for i in range(n):
        np.add.at(cnt, (rows[live[:, i]], order[live[:, i], i]), 1)
    w = np.where(live, np.take_along_axis(totals / np.maximum(cnt, 1), order, axis=1), -1.0)
    # heaviest first; among equal weights an expert's first copy before its replicas (stable on the order)
    seq = np.argsort(-w, axis=1, kind="stable")
    holds = np.zeros((L, G, E), dtype=bool)
    load = np.zeros((L, G), dtype=np.float64)
    free = np.full((L, G), S, dtype=np.int64)
    phy = np.full((L, G, S), -1, dtype=np.int64)
    for j in range(n):
        idx = seq[:, j]
        ok_l = live[rows, idx]
        e = order[rows, idx]
        ok = (free > 0) & ~holds[rows, :, e]  # [L, G]
        dst = np.argmin(np.where(ok, load, np.inf), axis=1)
        place = ok_l & ok[rows, dst]
        lp, gp, ep = rows[place], dst[place], e[place]
        phy[lp, gp, S - free[lp, gp]] = ep
        holds[lp, gp, ep] = True
        load[lp, gp] += w[lp, idx[place]]
        free[lp, gp] -= 1
    return phy.reshape(L, G * S)


def layer_max_load(table_phy: I64, base: RoutingTable, steps: npt.NDArray[np.integer], chunk: int = 256) -> F64:
    """Sum over steps of each layer's max rank load. steps: [T, L, E] -> [L]."""
    t = base.successor(table_phy)
    out = np.zeros(base.layers, dtype=np.float64)
    for a in range(0, steps.shape[0], chunk):
        out += rank_load(t, steps[a:a + chunk]).max(axis=-1).sum(axis=0)
    return out


def craft_table(base: RoutingTable, steps: npt.NDArray[np.integer], budget: int | None = None) -> RoutingTable:
    """Plan CRAFT from a replay buffer `steps [T, L, E]` for `base`'s cluster (every expert is placed anew).

    budget: total extra replica slots over all layers (default: EPLB's, every slot beyond one copy of each
    expert, G x S - E a layer). Returns the successor of `base` with the chosen placement.
    """
    s = np.asarray(steps)
    if s.ndim != 3 or s.shape[1:] != (base.layers, base.experts):
        raise InvalidShape(f"steps shape {s.shape}: expected [T, {base.layers}, {base.experts}]")
    topo = base.topology
    free_per_layer = min(topo.ranks * topo.slots_per_rank - base.experts, base.experts * (topo.ranks - 1))
    b = free_per_layer * base.layers if budget is None else int(budget)
    opts = replica_options(free_per_layer)
    totals = s.sum(axis=0, dtype=np.int64).astype(np.float64)
    placements = [pack_layers(base, totals, np.full(base.layers, int(r), dtype=np.int64)) for r in opts]
    maxload = np.stack([layer_max_load(p, base, s) for p in placements], axis=1)  # [L, K]
    benefit = maxload[:, :1] - maxload
    choice = mckp(benefit, opts, b)
    phy = np.stack([placements[int(k)][layer] for layer, k in enumerate(choice.tolist())])
    table = base.successor(phy)
    table.validate()
    return table
