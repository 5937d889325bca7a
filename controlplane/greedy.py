"""Per-layer greedy search of the planner: one operation per layer per round, every layer at once.

Works on block totals X [nb, L, E] (tokens per block of a few steps). A layer's objective is the sum over
blocks of its max rank load under the even split (`controlplane.load`: an expert's tokens split over its
replicas, remainders to the lowest ranks; a rank holds at most one replica of an expert, so replica order
is rank order and a rank's share depends only on which ranks hold the expert). Each round, every layer
still improving scores the moves off its hottest rank (most tokens over the blocks):

- REPLICATE an expert of the hot rank onto a destination with a free slot;
- MIGRATE it there (the hot rank's slot becomes free);
- where the destination is full, first drop its coldest replica of an expert held twice (a Consolidate onto
  the other holder: no bytes move, a slot frees), then replicate or migrate into the freed slot.

Destinations: the `DESTS - 1` coolest active ranks with a free slot, the 2 coolest full ones that hold a
droppable second replica, and the coolest free one on the hot rank's node (nearest first among equals).
The stability profile is the prior: a rank holding bursty_hot experts counts a quarter of the mean load per
such expert as headroom when destinations are ordered, and a stable_cold second replica is dropped first.
A candidate is scored by (reduction of the layer's objective, reduction of the sum of squared rank loads,
nearer tier, generation order), lexicographically: with several ranks near the max no single move lowers
the max, and the squares tie-break keeps moving load from hot to cool until it does. Scores use upper
bounds for the ranks a move touches (a replica's share rounded up), so they are conservative; after the
round every chosen move is applied exactly and each layer's exact objective recorded, so a plan's estimate
is the exact reduction of the objective on X. A layer stops when nothing scores, or after `PATIENCE`
moves in a row that did not lower its objective. Loops run over rounds (a few dozen), never over tokens,
experts or candidates. Ties break by ids: deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.cost import CostModel, tier_matrix
from controlplane.profile import ExpertClass
from controlplane.table import RoutingTable
from controlplane.verify import RankLoadKernel

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
B = npt.NDArray[np.bool_]
BIG = np.iinfo(np.int64).max // 4
REPLICATE, MIGRATE = 0, 1
DESTS = 4  # coolest ranks with a free slot tried as destinations, plus 2 full ones and the nearest
RUNNERS_UP = 3  # first-round alternatives explained per layer (superseded): enough to say what else scored
PATIENCE = 4  # moves in a row without lowering a layer's objective before the layer stops

# candidate status codes (the planner maps them to Reasons)
OK, NO_GAIN, COOLDOWN, NO_FREE_SLOT, OVER_REPLICA_BUDGET = 0, 1, 2, 3, 4


def shares(x: I64, hold: B) -> I64:
    """Exact even split: x [nb, n] tokens of one expert per layer, hold [n, G] ranks holding it ->
    tokens per rank [nb, n, G] (replica j of r gets (x + r - 1 - j) // r; j = rank order)."""
    r = hold.sum(axis=1)  # [n]
    j = np.cumsum(hold, axis=1) - 1
    s = (x[:, :, None] + (r[:, None] - 1 - j)[None]) // np.maximum(r, 1)[None, :, None]
    return np.where(hold[None], s, 0)


def _top3(V: I64) -> tuple[I64, I64]:
    """Indices and values of the 3 largest along the last axis (ties: lowest index) -> ([..., 3], [..., 3])."""
    V = V.copy()
    idx, val = [], []
    for _ in range(min(3, V.shape[-1])):
        i = np.argmax(V, axis=-1)[..., None]
        idx.append(i)
        val.append(np.take_along_axis(V, i, axis=-1))
        np.put_along_axis(V, i, -BIG, axis=-1)
    while len(idx) < 3:
        idx.append(np.full_like(idx[0], -1))
        val.append(np.full_like(val[0], 0))
    return np.concatenate(idx, axis=-1), np.concatenate(val, axis=-1)


def _first_outside(t: I64, v: I64, a: I64, b: I64) -> I64:
    """The first of the top-3 (t, v [..., 3]) whose index is neither a nor b (broadcast) -> [...] (>= 0)."""
    ok = (t != a) & (t != b) & (t >= 0)
    return np.asarray(np.where(ok, v, -1).max(axis=-1).clip(min=0), dtype=np.int64)


@dataclass
class Moves:
    """Moves in generation order (round-major, then layer). Arrays [K]. victim/keep: the replica dropped
    first (-1: none) and the rank where its other replica stays; obj: the layer's exact objective after."""

    round: I64
    layer: I64
    kind: I64
    expert: I64
    src: I64
    dst: I64
    victim: I64
    keep: I64
    obj: I64
    cost: F64
    replicas: I64  # change in extra replicas


@dataclass
class Refusals:
    """Candidates not taken, arrays [K]: layer, kind, expert, src, dst, victim, keep, status, gain
    (reduction of the objective, upper bound), cost; superseded: another move of the layer was chosen."""

    layer: I64
    kind: I64
    expert: I64
    src: I64
    dst: I64
    victim: I64
    keep: I64
    status: I64
    gain: I64
    superseded: B


class Greedy:
    """The working placement of every layer while moves are chosen."""

    def __init__(self, table: RoutingTable, X: I64, steps: int, cost: CostModel, classes: npt.NDArray[np.int8],
                 cool: B) -> None:
        topo = table.topology
        self.L, self.E, self.G, self.S = table.layers, table.experts, topo.ranks, topo.slots_per_rank
        L, G, S = self.L, self.G, self.S
        self.X = X
        self.xs = X.sum(axis=0)  # [L, E]
        self.tok = self.xs / max(steps, 1)
        self.phy = np.array(table.phy2log, dtype=np.int64).reshape(L, G, S)
        self.has = table.holders.copy()  # [L, E, G], updated as moves apply
        self.cnt = np.array(table.logcnt, dtype=np.int64)
        self.active = table.active_mask
        self.free = ((self.phy < 0).sum(axis=2) * self.active[None, :]).astype(np.int64)  # [L, G]
        self.R = RankLoadKernel(table).rank_load(X)  # [nb, L, G] exact (replica order = rank order)
        self.phy0 = self.phy.copy()  # copies come from the head's holders (as table.diff prices them)
        self.obj0 = self.R.max(axis=2).sum(axis=0)  # [L]
        self.obj = self.obj0.copy()
        self.node = np.arange(G) // topo.ranks_per_node
        self.tiers = tier_matrix(topo)
        self.tier_s = cost.tier_costs(topo)
        self.cm = cost
        self.cls, self.cool = classes, cool
        self.any_bursty = bool((classes == ExpertClass.BURSTY_HOT).any())

    # ---- one round -------------------------------------------------------------------------
    def candidates(self, ls: I64, rep_ok: B) -> tuple[dict[str, I64], I64]:
        """Score every candidate of layers `ls` [n]; rep_ok [n]: may this layer add a replica.
        Returns the candidate arrays (each [n, S, D, 2]) and each layer's best flat index (-1: none)."""
        G, S = self.G, self.S
        n = ls.size
        R = self.R[:, ls]  # [nb, n, G]
        Rs = R.sum(axis=0)
        act = self.active
        h = np.argmax(np.where(act, Rs, -1), axis=1)  # hot rank [n]
        ar = np.arange(G)[None, :]
        free = (self.free[ls] > 0) & act & (ar != h[:, None])  # [n, G]
        # victims on every full rank: an expert held twice, not cooling, coldest (stable_cold first)
        L_ = ls[:, None, None]
        on = self.phy[ls]  # [n, G, S]
        ve = np.maximum(on, 0)
        vok = (on >= 0) & (self.cnt[L_, ve] == 2) & ~self.cool[L_, ve]
        vkey = np.where(vok, (self.cls[L_, ve] != ExpertClass.STABLE_COLD) * (BIG // 2) + self.xs[L_, ve] * self.E + ve,
                        BIG)
        vs = np.argmin(vkey, axis=2)
        vic_all = np.where(np.take_along_axis(vkey, vs[:, :, None], 2)[:, :, 0] < BIG,
                           np.take_along_axis(on, vs[:, :, None], 2)[:, :, 0], -1)  # [n, G]
        roomy = ~free & (vic_all >= 0) & act & (ar != h[:, None])
        same = (self.node[None, :] == self.node[h][:, None]) & free
        # destinations: the coolest with a free slot, the coolest full ones with a victim, the coolest free
        # rank on the hot rank's node (nearest target first)
        kf, kv = min(DESTS - 1, G), min(2, G)
        key = Rs  # coolest first; a rank holding bursty_hot experts keeps headroom (a quarter mean each)
        if self.any_bursty:
            nb_ = ((on >= 0) & (self.cls[L_, ve] == ExpertClass.BURSTY_HOT)).sum(axis=2)
            key = Rs + nb_ * (Rs.sum(axis=1) // max(int(act.sum()), 1) // 4)[:, None]
        of = np.argsort(np.where(free, key, BIG), axis=1, kind="stable")[:, :kf]
        ov = np.argsort(np.where(roomy, key, BIG), axis=1, kind="stable")[:, :kv]
        near = np.argmin(np.where(same, key, BIG), axis=1)[:, None]
        dests = np.concatenate([of, ov, near], axis=1)  # [n, D]
        dvalid = np.concatenate([np.take_along_axis(free, of, 1), np.take_along_axis(roomy, ov, 1),
                                 np.take_along_axis(same, near, 1) & ~(of == near).any(axis=1, keepdims=True)], axis=1)
        D = dests.shape[1]
        has_free = np.take_along_axis(free, dests, 1)
        victim = np.where(has_free, -1, np.take_along_axis(vic_all, dests, 1))  # [n, D]
        vhold = self.has[ls[:, None], np.maximum(victim, 0)]  # [n, D, G]
        keep = np.argmax(vhold & (np.arange(G)[None, None, :] != dests[:, :, None]), axis=2)
        keep = np.where(victim >= 0, keep, -1)
        # hot experts and their shares on the hot rank
        ex = self.phy[ls, h]  # [n, S]
        e0 = np.maximum(ex, 0)
        x = self.X[:, ls[:, None], e0]  # [nb, n, S]
        r = self.cnt[ls[:, None], e0]  # [n, S]
        hold = self.has[ls[:, None], e0]  # [n, S, G]
        jh = np.cumsum(hold, axis=2)[np.arange(n)[:, None], np.arange(S)[None, :], h[:, None]] - 1  # [n, S]
        sh = (x + (r - 1 - jh)[None]) // np.maximum(r, 1)[None]  # share on h [nb, n, S]
        up_rep = (x + r[None]) // (r + 1)[None]  # upper bound of a replica's share with r + 1
        up_mig = (x + r[None] - 1) // np.maximum(r, 1)[None]
        Rh = R[:, np.arange(n), h]  # [nb, n]
        Rd = np.take_along_axis(R, np.broadcast_to(dests[None], (R.shape[0], n, D)), axis=2)  # [nb, n, D]
        xv = self.X[:, ls[:, None], np.maximum(victim, 0)]  # [nb, n, D]
        rv = np.where(victim >= 0, 2, 1)
        jv_d = np.where(keep < dests, 1, 0)  # victim's replica index on d (two holders: keep and d)
        sv_d = np.where(victim >= 0, (xv + (rv - 1 - jv_d)[None]) // rv[None], 0)
        sv_k = np.where(victim >= 0, xv - sv_d, 0)  # the keeper's share before; after it takes all of xv
        keep_is_h = keep == h[:, None]
        # max over ranks not touched: top-4 per block, first not in {h, d, keep}
        # max over the ranks a move leaves alone: top-3 without the hot rank, first not in {d, keep};
        # a replication also lowers the other holders of e to at most the new share
        hmask = np.arange(G)[None, :] == h[:, None]  # [n, G]
        t_m, v_m = _top3(np.where(hmask[None], -1, R))  # [nb, n, 3]
        other_m = _first_outside(t_m[:, :, None, :], v_m[:, :, None, :], dests[None, :, :, None],
                                 keep[None, :, :, None])  # [nb, n, D]
        t_r = np.broadcast_to(t_m[:, :, None, :], (R.shape[0], n, S, 3)).copy()  # [nb, n, S, 3]
        v_r = np.broadcast_to(v_m[:, :, None, :], t_r.shape).copy()
        li, si = np.nonzero(r >= 2)  # only an expert held elsewhere too changes other ranks
        if li.size:
            hs = shares(x[:, li, si], hold[li, si])  # [nb, m, G]
            Rp = R[:, li, :] - np.where(hold[li, si][None], hs - up_rep[:, li, si][..., None], 0)
            t_r[:, li, si], v_r[:, li, si] = _top3(np.where(hmask[li][None], -1, np.maximum(Rp, 0)))
        other_r = _first_outside(t_r[:, :, :, None, :], v_r[:, :, :, None, :], dests[None, :, None, :, None],
                                 keep[None, :, None, :, None])  # [nb, n, S, D]
        other = np.stack([other_r, np.broadcast_to(other_m[:, :, None, :], other_r.shape)], axis=-1)
        Rk = np.take_along_axis(R, np.broadcast_to(np.maximum(keep, 0)[None], (R.shape[0], n, D)), axis=2)
        k_new = np.where((victim >= 0) & ~keep_is_h, Rk + xv - sv_k, 0)  # [nb, n, D]
        h_extra = np.where((victim >= 0) & keep_is_h, xv - sv_k, 0)  # [nb, n, D]
        # new loads [nb, n, S, D, 2]
        dshare = np.stack([up_rep, up_mig], axis=-1)[:, :, :, None, :]  # [nb, n, S, 1, 2]
        hnew = (Rh[:, :, None, None, None] - sh[:, :, :, None, None]
                + np.stack([up_rep, np.zeros_like(up_rep)], axis=-1)[:, :, :, None, :] + h_extra[:, :, None, :, None])
        dnew = (Rd - sv_d)[:, :, None, :, None] + dshare
        newmax = np.maximum(np.maximum(hnew, dnew), np.maximum(other, k_new[:, :, None, :, None]))
        oldmax = R.max(axis=2)  # [nb, n]
        df = (oldmax[:, :, None, None, None] - newmax).sum(axis=0)  # [n, S, D, 2]
        Rh5 = Rh[:, :, None, None, None]
        dsq = (hnew**2 - Rh5**2 + dnew**2 - (Rd**2)[:, :, None, :, None]).sum(axis=0)
        dsq = dsq + np.where((victim >= 0) & ~keep_is_h, (k_new**2 - Rk**2).sum(axis=0), 0)[:, None, :, None]
        # validity
        e_on_d = hold[np.arange(n)[:, None, None], np.arange(S)[None, :, None], dests[:, None, :]]  # [n, S, D]
        some = (ex >= 0)[:, :, None] & ~e_on_d & (dests != h[:, None])[:, None, :]
        nofree = np.zeros((n, D), dtype=bool)
        nofree[:, :kf] = ~dvalid[:, :kf]  # fewer ranks with a free slot than asked for: say so
        st3 = np.where(some & dvalid[:, None, :], OK, np.where(some & nofree[:, None, :], NO_FREE_SLOT, -1))
        status = np.ascontiguousarray(np.broadcast_to(st3[..., None], (n, S, D, 2))).astype(np.int64)
        gain_ok = (df > 0) | ((df == 0) & (dsq < 0))
        status[(status == OK) & ~gain_ok] = NO_GAIN
        cool = self.cool[ls[:, None], e0][:, :, None, None] | (self.cool[ls[:, None], np.maximum(victim, 0)]
                                                                & (victim >= 0))[:, None, :, None]
        status[(status == OK) & np.broadcast_to(cool, status.shape)] = COOLDOWN
        adds = np.broadcast_to((np.array([1, 0])[None, None, None, :] - (victim >= 0)[:, None, :, None]) > 0,
                               status.shape)
        status[(status == OK) & adds & ~rep_ok[:, None, None, None]] = OVER_REPLICA_BUDGET
        tier = np.broadcast_to(self.tiers[h[:, None], dests][:, None, :, None], status.shape)
        # best per layer: df, then -dsq, then nearer tier, then generation order
        def flat(a: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
            return np.broadcast_to(a, status.shape).reshape(n, -1)

        okf = flat(status == OK)
        dff, dsf, tf = flat(df), flat(dsq), flat(tier)
        m1 = okf & (dff == np.where(okf, dff, -BIG).max(axis=1, initial=-BIG)[:, None])
        m2 = m1 & (dsf == np.where(m1, dsf, BIG).min(axis=1, initial=BIG)[:, None])
        m3 = m2 & (tf == np.where(m2, tf, BIG).min(axis=1, initial=BIG)[:, None])
        best = np.where(m3.any(axis=1), np.argmax(m3, axis=1), -1)
        shape = status.shape
        c: dict[str, npt.NDArray[np.generic]] = {
            "layer": np.broadcast_to(ls[:, None, None, None], shape), "kind": np.broadcast_to(np.arange(2), shape),
            "expert": np.broadcast_to(ex[:, :, None, None], shape), "src": np.broadcast_to(h[:, None, None, None], shape),
            "dst": np.broadcast_to(dests[:, None, :, None], shape), "victim": np.broadcast_to(victim[:, None, :, None], shape),
            "keep": np.broadcast_to(keep[:, None, :, None], shape), "status": status, "gain": df,
        }
        return {k2: np.ascontiguousarray(v, dtype=np.int64).reshape(n, -1) for k2, v in c.items()}, best

    def apply(self, c: dict[str, I64], rows: I64, idx: I64) -> tuple[I64, F64, I64]:
        """Apply the chosen candidate idx [m] of rows [m] (distinct layers). Returns the layers' exact
        objectives after [m], each move's cost [m] and its change in extra replicas [m]."""
        g = {k: np.asarray(v[rows, idx], dtype=np.int64) for k, v in c.items()}
        lay, e, h, d, kind, v = g["layer"], g["expert"], g["src"], g["dst"], g["kind"], g["victim"]
        nb = self.X.shape[0]
        drop = v >= 0
        # cost before the state changes: nearest holder of e, downtime of the moved experts' traffic
        held = (self.phy0[lay] == e[:, None, None]).any(axis=2)  # [m, G] holders in the head
        tier = np.where(held, self.tiers[:, d].T, 3).min(axis=1)
        cost = self.tier_s[tier] + self.cm.downtime_steps * self.cm.penalty_s * (
            self.tok[lay, e] + np.where(drop, self.tok[lay, np.maximum(v, 0)], 0.0))
        dl = lay[drop]
        if dl.size:
            vv, dd = v[drop], d[drop]
            old = self.has[dl, vv].copy()
            self.has[dl, vv, dd] = False
            self.R[:, dl] += shares(self.X[:, dl, vv], self.has[dl, vv]) - shares(self.X[:, dl, vv], old)
            self.cnt[dl, vv] -= 1
            self.free[dl, dd] += 1
            slot = np.argmax(self.phy[dl, dd] == vv[:, None], axis=1)
            self.phy[dl, dd, slot] = -1
        old = self.has[lay, e].copy()
        mig = kind == MIGRATE
        self.has[lay[mig], e[mig], h[mig]] = False
        self.has[lay, e, d] = True
        self.R[:, lay] += shares(self.X[:, lay, e], self.has[lay, e]) - shares(self.X[:, lay, e], old)
        self.cnt[lay, e] += np.where(mig, 0, 1)
        self.free[lay, d] -= 1
        self.free[lay[mig], h[mig]] += 1
        hs = np.argmax(self.phy[lay[mig], h[mig]] == e[mig][:, None], axis=1)
        self.phy[lay[mig], h[mig], hs] = -1
        fs = np.argmax(self.phy[lay, d] < 0, axis=1)
        self.phy[lay, d, fs] = e
        self.obj[lay] = self.R[:, lay].max(axis=2).sum(axis=0) if nb else 0
        return self.obj[lay].copy(), cost, np.where(mig, 0, 1) - drop.astype(np.int64)


def search(table: RoutingTable, X: I64, steps: int, cost: CostModel, classes: npt.NDArray[np.int8], cool: B,
           max_ops: int) -> tuple[Greedy, Moves, Refusals]:
    """Rounds of one move per improving layer until no layer improves, `max_ops` moves were generated
    or their cost passed the budget. Returns the final state, the moves and the last candidates of every
    layer that stopped (with why) plus the first round's runners-up (superseded)."""
    st = Greedy(table, X, steps, cost, classes, cool)
    alive = np.flatnonzero(st.obj0 > 0).astype(np.int64)
    streak = np.zeros(st.L, dtype=np.int64)
    best_obj = st.obj0.copy()
    parts: list[list[npt.NDArray[np.generic]]] = []
    ref: list[dict[str, I64]] = []
    sup: list[B] = []
    extra = int((st.cnt - 1).clip(min=0).sum())
    cap = cost.replica_budget
    spent, count, rnd = 0.0, 0, 0
    while alive.size and count < max_ops and spent <= cost.budget_s:
        room = BIG if cap is None else max(cap - extra, 0)
        rep_ok = np.arange(alive.size) < room
        c, best = st.candidates(alive, rep_ok)
        chosen = best >= 0
        stop = ~chosen
        if rnd == 0 or stop.any():
            rows = np.flatnonzero(stop) if rnd else np.arange(alive.size)
            sel = c["status"][rows] >= 0
            if rnd == 0:  # the best RUNNERS_UP valid alternatives of the first round: superseded
                alt = sel & (np.arange(sel.shape[1])[None, :] != best[rows][:, None]) & (c["status"][rows] == OK)
                top = np.argsort(np.where(alt, -c["gain"][rows], BIG), axis=1, kind="stable")[:, :RUNNERS_UP]
                keep_alt = np.zeros_like(alt)
                np.put_along_axis(keep_alt, top, True, axis=1)
                sel &= np.where(stop[rows][:, None], True, alt & keep_alt)
            ref.append({k: v[rows][sel] for k, v in c.items()})
            sup.append(np.broadcast_to(chosen[rows][:, None], sel.shape)[sel] & (rnd == 0))
        rows = np.flatnonzero(chosen)
        if rows.size:
            obj, cs, dr = st.apply(c, rows, best[rows])
            lay = alive[rows]
            g = {k: np.asarray(v[rows, best[rows]], dtype=np.int64) for k, v in c.items()}
            parts.append([np.full(rows.size, rnd), lay, g["kind"], g["expert"], g["src"], g["dst"], g["victim"],
                          g["keep"], obj, cs, dr])
            better = obj < best_obj[lay]
            best_obj[lay] = np.minimum(best_obj[lay], obj)
            streak[lay] = np.where(better, 0, streak[lay] + 1)
            spent += float(cs.sum())
            count += rows.size
            extra += int(dr.sum())
            stop[rows] = streak[lay] >= PATIENCE
        alive = alive[~stop]
        rnd += 1
    cols = [np.concatenate(p) for p in zip(*parts, strict=True)] if parts else [np.zeros(0)] * 11
    i64 = [np.asarray(a, dtype=np.int64) for a in cols]
    mv = Moves(i64[0], i64[1], i64[2], i64[3], i64[4], i64[5], i64[6], i64[7], i64[8],
               np.asarray(cols[9], dtype=np.float64), i64[10])

    def cat(k: str) -> I64:
        return np.concatenate([r[k] for r in ref]).astype(np.int64) if ref else np.zeros(0, dtype=np.int64)

    rf = Refusals(cat("layer"), cat("kind"), cat("expert"), cat("src"), cat("dst"), cat("victim"), cat("keep"),
                  cat("status"), cat("gain"), np.concatenate(sup) if sup else np.zeros(0, dtype=bool))
    return st, mv, rf
