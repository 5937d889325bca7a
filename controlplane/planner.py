"""Incremental planner: a handful of replicate / migrate / consolidate operations, never a reshuffle.

Works on the replay buffer's block totals X [nb, L, E] (tokens per block of a few steps). A layer's
objective is the sum over blocks of its max rank load; the estimated gain of a plan is how much it lowers
the sum over layers (exact on X, integer), relative to it. For every layer, the experts on its hottest rank are
candidates to replicate or migrate towards the coolest active rank with a free slot and towards the coolest
such rank on the hot rank's own node (nearest target first; cost decides between them). Where the coolest
rank has no free slot, a cold replicated expert there is consolidated to free one (stable_cold first).
Candidates of all layers are scored at once (vectorised: only the affected ranks change) and picked greedily
by gain per cost up to `max_ops`, within the cost budget and the replica budget; after each pick its layer is
re-planned. Selection uses a surrogate, 4 x the largest + the second largest rank load, because when two
ranks tie at the max no single operation lowers the max, yet relieving one of them lets the next one pay off.
Every candidate not chosen is returned with a stable reason code. Ties break by layer, then generation
order (hot expert slot, target, kind): deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from controlplane.cost import CostModel, extra_replicas, tier_matrix
from controlplane.ops import Consolidate, Migrate, Operation, Replicate, describe
from controlplane.profile import ExpertClass, StabilityProfile
from controlplane.table import RoutingTable
from controlplane.verify import RankLoadKernel

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
BIG = np.iinfo(np.int64).max // 4
REPLICATE, MIGRATE, CONS_REPLICATE, CONS_MIGRATE = 0, 1, 2, 3
PENDING, CHOSEN = 0, 1


class Reason(StrEnum):
    NO_GAIN = "NO_GAIN"  # does not lower its layer's max rank load
    GAIN_BELOW_TAU = "GAIN_BELOW_TAU"  # a candidate below tau / max_ops, or a plan below tau
    NO_FREE_SLOT = "NO_FREE_SLOT"  # no active rank can take it, even after consolidating a cold replica
    OVER_BUDGET = "OVER_BUDGET"  # would exceed the decision's cost budget
    OVER_REPLICA_BUDGET = "OVER_REPLICA_BUDGET"  # would exceed the replica-memory budget
    MAX_OPS = "MAX_OPS"  # the plan is full
    SUPERSEDED = "SUPERSEDED"  # its layer changed under an op chosen before it; the layer was re-planned
    COOLDOWN = "COOLDOWN"  # the expert was part of a rolled-back change
    VERIFY_NO_GAIN = "VERIFY_NO_GAIN"  # its layer did not gain when replayed step by step


REASONS = tuple(Reason)
_REASON_TEXT = tuple(r.value for r in REASONS)
_CODE = {r: 2 + i for i, r in enumerate(REASONS)}


def _code(r: Reason) -> int:
    return _CODE[r]


class Refused(NamedTuple):
    """A candidate not taken: `op` (None for the plan as a whole), a Reason, its estimated relative gain
    and its cost in seconds; `detail` says more (e.g. the consolidation it needed). A NamedTuple: a plan
    refuses about a thousand candidates at DeepSeek-V3 shape, and this builds 3x faster than a dataclass."""

    op: Operation | None
    reason: str
    gain: float
    cost: float
    detail: str = ""

    def describe(self) -> str:
        what = describe(self.op) if self.op is not None else "plan"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{what}: {self.reason} gain {self.gain:.4f} cost {self.cost * 1e3:.3f} ms{extra}"


@dataclass(frozen=True)
class Plan:
    """ops in the order to apply; op_layers: the layer of each op; gain relative to X's imbalance."""

    ops: tuple[Operation, ...]
    op_layers: tuple[int, ...]
    estimated_gain: float
    cost: float
    refused: tuple[Refused, ...]
    layer_gain: tuple[tuple[int, float], ...] = ()  # (layer, its share of estimated_gain): additive


@dataclass
class _Cands:
    layer: I64
    kind: I64
    expert: I64
    src: I64
    dst: I64
    victim: I64
    vdst: I64
    old: I64  # [C, 2, Ra] slots before, per changed expert (-1 padded)
    new: I64  # [C, 2, Ra] slots after
    gain: I64  # reduction of the layer's objective (sum over blocks of the max rank load), tokens
    sgain: I64  # reduction of the selection surrogate (sum over blocks of 4 x max + second max)
    cost: F64
    prio: F64
    new_r: I64  # [C, nw, G] rank loads of the layer after the candidate
    status: I64  # PENDING, CHOSEN or 2 + index into REASONS


class _State:
    """The working placement while a plan grows; every array is updated for the one layer that changes."""

    def __init__(self, table: RoutingTable, X: I64, steps: int, cost: CostModel,
                 profile: StabilityProfile | None, cooldown: npt.NDArray[np.bool_] | None, max_ops: int) -> None:
        topo = table.topology
        self.table, self.topo, self.cm = table, topo, cost
        self.L, self.E, self.G, self.S = table.layers, table.experts, topo.ranks, topo.slots_per_rank
        self.X = X
        self.xsum = X.sum(axis=0)  # [L, E]
        self.tok = self.xsum / max(steps, 1)  # tokens per step
        self.phy = np.array(table.phy2log).reshape(self.L, self.G, self.S)
        self.cnt = np.array(table.logcnt)
        ra = int(table.log2phy.shape[2]) + max_ops + 1
        self.l2p = np.full((self.L, self.E, ra), -1, dtype=np.int64)
        self.l2p[:, :, : table.log2phy.shape[2]] = table.log2phy
        self.R = RankLoadKernel(table).rank_load(X)  # [nw, L, G]
        self.obj = self.R.max(axis=2).sum(axis=0)  # [L]
        self.obj0 = self.obj.copy()
        self.sur = _top2(self.R).sum(axis=0)  # [L]
        self.base = int(self.obj.sum())
        self.base_sur = int(self.sur.sum())
        self.active = table.active_mask
        self.node = np.arange(self.G) // topo.ranks_per_node
        self.tiers = tier_matrix(topo)
        self.tier_s = cost.tier_costs(topo)
        cls = profile.classes if profile is not None else np.zeros((self.L, self.E), dtype=np.int8)
        self.cls = cls
        self.any_bursty = bool((cls == ExpertClass.BURSTY_HOT).any())
        self.cool = cooldown if cooldown is not None else np.zeros((self.L, self.E), dtype=bool)
        self.min_gain = 0.0

    # ---- candidate generation (vectorised over `ls`) ----------------------------------------------
    def generate(self, ls: I64, refused: dict[tuple[object, ...], Refused]) -> _Cands:
        S = self.S
        n = ls.size
        Rs = self.R[:, ls].sum(axis=0)  # [n, G]
        hot = np.argmax(np.where(self.active, Rs, -1), axis=1)
        phy = self.phy[ls]  # [n, G, S]
        ex = phy[np.arange(n), hot]  # [n, S]
        empty = phy < 0
        has_free = empty.any(axis=2) & self.active
        first_free = np.argmax(empty, axis=2)  # [n, G]
        nb = ((np.where(phy >= 0, self.cls[ls[:, None, None], np.maximum(phy, 0)], 0) == ExpertClass.BURSTY_HOT).sum(2)
              if self.any_bursty else np.zeros(Rs.shape, dtype=np.int64))
        mean = Rs[:, self.active].sum(axis=1) // max(1, int(self.active.sum()))
        key = np.where(self.active, Rs + nb * (mean[:, None] // 4), BIG)  # target order: coolest + headroom
        holds = (phy[:, None, :, :] == ex[:, :, None, None]).any(axis=3)  # [n, S, G]
        ok = has_free[:, None, :] & ~holds & (ex >= 0)[:, :, None]
        k1 = np.where(ok, key[:, None, :], BIG)
        t1 = np.argmin(k1, axis=2)
        e1 = np.take_along_axis(k1, t1[:, :, None], 2)[:, :, 0] < BIG
        k2 = np.where(ok & (self.node[None, :] == self.node[hot][:, None])[:, None, :], k1, BIG)
        t2 = np.argmin(k2, axis=2)
        e2 = (np.take_along_axis(k2, t2[:, :, None], 2)[:, :, 0] < BIG) & (t2 != t1)
        rows: list[I64] = []  # (i, s, kind, dst, victim, vdst)
        for tgt, exists in ((t1, e1), (t2, e2)):
            i, s = np.nonzero(exists)
            for k in (REPLICATE, MIGRATE):
                rows.append(np.stack([i, s, np.full_like(i, k), tgt[i, s], -np.ones_like(i), -np.ones_like(i)], 1))
        rows.append(self._compound(ls, hot, phy, ex, key, e1, refused))
        cand = np.concatenate(rows, axis=0) if rows else np.zeros((0, 6), dtype=np.int64)
        cand = cand[np.lexsort((cand[:, 2], cand[:, 3], cand[:, 1], cand[:, 0]))] if cand.size else cand
        i, s, kind, dst, vic, vdst = (cand[:, k] for k in range(6))
        layer, e, h = ls[i], ex[i, s], hot[i]
        new_slot = dst * S + first_free[i, dst]
        is_cons = kind >= CONS_REPLICATE
        new_slot = np.where(is_cons, -1, new_slot)
        C = cand.shape[0]
        ra = self.l2p.shape[2]
        old = np.full((C, 2, ra), -1, dtype=np.int64)
        old[:, 0] = self.l2p[layer, e]
        old[is_cons, 1] = self.l2p[layer[is_cons], vic[is_cons]]
        new = old.copy()
        vslot = np.where(old[:, 1] // S == dst[:, None], old[:, 1], -1).max(axis=1)  # victim's slot on dst
        new[is_cons, 1] = np.where(old[is_cons, 1] // S == vdst[is_cons, None], old[is_cons, 1], -1)
        new_slot = np.where(is_cons, vslot, new_slot)
        mig = (kind == MIGRATE) | (kind == CONS_MIGRATE)
        on_h = (old[:, 0] >= 0) & (old[:, 0] // S == h[:, None])
        new[:, 0] = np.where(mig[:, None] & on_h, new_slot[:, None], new[:, 0])
        rep_col = np.argmax(new[:, 0] < 0, axis=1)
        rep = ~mig
        new[rep, 0, rep_col[rep]] = new_slot[rep]
        m = max(1, int((old >= 0).sum(axis=2).max(initial=0)), int((new >= 0).sum(axis=2).max(initial=0)))
        old, new = old[:, :, :m], new[:, :, :m]  # replica lists are left-packed: trim the padding
        new_r = self._evaluate(layer, np.stack([e, np.where(is_cons, vic, 0)], 1), old, new)
        gain = self.obj[layer] - new_r.max(axis=2).sum(axis=1)
        sgain = self.sur[layer] - _top2(new_r).sum(axis=1)
        held = old[:, 0] >= 0
        tier = np.where(held, self.tiers[np.where(held, old[:, 0] // S, 0), dst[:, None]], 3).min(axis=1)
        cm = self.cm
        cost = self.tier_s[tier] + cm.downtime_steps * cm.penalty_s * (
            self.tok[layer, e] + np.where(is_cons, self.tok[layer, np.maximum(vic, 0)], 0.0))
        w = np.where((kind % 2 == 0) & (self.cls[layer, e] == ExpertClass.STABLE_HOT), 1.5, 1.0)
        prio = sgain / max(self.base_sur, 1) / np.maximum(cost, 1e-12) * w
        cool = self.cool[layer, e] | (is_cons & self.cool[layer, np.maximum(vic, 0)])
        status = np.select(
            [sgain <= 0, cool, sgain < self.min_gain],
            [_code(Reason.NO_GAIN), _code(Reason.COOLDOWN), _code(Reason.GAIN_BELOW_TAU)], PENDING).astype(np.int64)
        return _Cands(layer, kind, e, h, dst, vic, vdst, old, new, gain, sgain, cost, prio, new_r, status)

    def _compound(self, ls: I64, hot: I64, phy: I64, ex: I64, key: I64, e1: npt.NDArray[np.bool_],
                  refused: dict[tuple[object, ...], Refused]) -> I64:
        """Rows for 'consolidate a cold replica on the coolest rank, then move a hot expert there', for
        layers whose coolest active rank has no free slot; NO_FREE_SLOT refusals where that is impossible."""
        S = self.S
        n = ls.size
        tstar = np.argmin(key, axis=1)  # coolest active rank
        full = ~(phy[np.arange(n), tstar] < 0).any(axis=1) & (tstar != hot)
        out: list[list[int]] = []
        for i in np.flatnonzero(full | ~e1.any(axis=1)).tolist():
            lay, t = int(ls[i]), int(tstar[i])
            vics = [int(v) for v in phy[i, t] if v >= 0 and self.cnt[lay, v] >= 2 and not self.cool[lay, v]]
            vic = min(vics, key=lambda v: (self.cls[lay, v] != ExpertClass.STABLE_COLD,
                                           int(self.xsum[lay, v]) // int(self.cnt[lay, v]), v)) if vics else -1
            if vic >= 0:
                hs = [int(p) // S for p in self.l2p[lay, vic] if p >= 0 and int(p) // S != t]
                vd = min(hs, key=lambda g: (int(key[i, g]), g))
            for s in range(S):
                e = int(ex[i, s])
                if e < 0 or (phy[i, t] == e).any():
                    continue
                if vic >= 0:
                    out += [[i, s, CONS_REPLICATE, t, vic, vd], [i, s, CONS_MIGRATE, t, vic, vd]]
                elif not e1[i, s]:
                    op = Replicate(lay, e, t)
                    refused[(op,)] = Refused(op, Reason.NO_FREE_SLOT.value, 0.0, 0.0,
                                             f"no free slot on an active rank of layer {lay}")
        return np.array(out, dtype=np.int64).reshape(-1, 6)

    def _evaluate(self, layer: I64, exp: I64, old: I64, new: I64) -> I64:
        """Rank loads [C, nw, G] of each candidate's layer after it: old [C, K, Ra] slots lose their even
        split of the expert's window totals, new slots gain theirs (replica order = slot order)."""
        nw, G, S = self.X.shape[0], self.G, self.S
        C, K, _ = old.shape
        x = self.X[:, layer[:, None], exp].transpose(1, 2, 0)  # [C, K, nw]
        idx_parts, val_parts = [], []
        cw = (np.arange(C)[:, None, None, None] * nw + np.arange(nw)[None, None, :, None]) * G  # [C,1,nw,1]
        for slots, sign in ((old, -1), (new, 1)):
            srt = np.sort(np.where(slots >= 0, slots, BIG), axis=2)
            valid = srt < BIG
            r = valid.sum(axis=2)  # [C, K]
            j = np.arange(srt.shape[2])
            share = (x[..., None] + (r[..., None, None] - 1 - j)) // np.maximum(r, 1)[..., None, None]
            share = np.where(valid[:, :, None, :], share, 0)  # [C, K, nw, Ra]
            rank = np.where(valid, srt // S, 0)[:, :, None, :]
            idx_parts.append((cw + rank).reshape(-1))
            val_parts.append((sign * share).reshape(-1))
        out = np.ascontiguousarray(self.R[:, layer].transpose(1, 0, 2))  # [C, nw, G]
        np.add.at(out.reshape(-1), np.concatenate(idx_parts), np.concatenate(val_parts))  # sparse: few ranks change
        return out

    def apply(self, c: _Cands, k: int) -> None:
        """Take candidate k: its layer's placement, replica lists, loads and objective."""
        lay = int(c.layer[k])
        flat = self.phy[lay].reshape(-1)
        for ch, e in ((1, int(c.victim[k])), (0, int(c.expert[k]))):  # the consolidation frees first
            if ch == 1 and c.kind[k] < CONS_REPLICATE:
                continue
            old, new = c.old[k, ch], c.new[k, ch]
            flat[old[old >= 0]] = -1
            ns = np.sort(new[new >= 0])
            flat[ns] = e
            self.cnt[lay, e] = ns.size
            self.l2p[lay, e] = -1
            self.l2p[lay, e, : ns.size] = ns
        self.R[:, lay] = c.new_r[k]
        self.obj[lay] = int(c.new_r[k].max(axis=1).sum())
        self.sur[lay] = int(_top2(c.new_r[k]).sum())


SURROGATE_MAX_WEIGHT = 4  # the max counts 4x the second largest: a max cut outweighs raising the runner-up


def _top2(r: I64) -> I64:
    """[..., G] -> [...] selection surrogate 4 x largest + second largest (4 x largest when G = 1)."""
    if r.shape[-1] < 2:
        return np.asarray(SURROGATE_MAX_WEIGHT * r.sum(axis=-1), dtype=np.int64)
    a = r.argmax(axis=-1)[..., None]
    rest = r.copy()
    np.put_along_axis(rest, a, np.iinfo(np.int64).min, axis=-1)
    out = SURROGATE_MAX_WEIGHT * np.take_along_axis(r, a, axis=-1)[..., 0] + rest.max(axis=-1)
    return np.asarray(out, dtype=np.int64)


def _ops_of(c: _Cands, k: int) -> tuple[Operation, ...]:
    lay, e, dst, kind = int(c.layer[k]), int(c.expert[k]), int(c.dst[k]), int(c.kind[k])
    main: Operation = Replicate(lay, e, dst) if kind % 2 == 0 else Migrate(lay, e, int(c.src[k]), dst)
    if kind >= CONS_REPLICATE:
        return (Consolidate(lay, (int(c.victim[k]),), int(c.vdst[k])), main)
    return (main,)


def plan(table: RoutingTable, X: npt.NDArray[np.integer], steps: int, cost: CostModel, max_ops: int, tau: float,
         profile: StabilityProfile | None = None, cooldown: npt.NDArray[np.bool_] | None = None) -> Plan:
    """Plan up to `max_ops` operations from `table`. X: window totals [nw, L, E] of the replay buffer (steps
    in all: `steps`); cooldown [L, E]: experts to leave alone. A candidate must gain at least tau / max_ops
    of the estimated imbalance. Deterministic."""
    X64: I64 = np.asarray(X, dtype=np.int64)
    st = _State(table, X64, steps, cost, profile, cooldown, max_ops)
    refused: dict[tuple[object, ...], Refused] = {}
    if st.base == 0 or max_ops < 1:
        return Plan((), (), 0.0, 0.0, ())
    st.min_gain = tau / max_ops * st.base_sur
    pools = [st.generate(np.arange(table.layers, dtype=np.int64), refused)]
    chosen: list[tuple[_Cands, int]] = []
    spent = 0.0
    replicas = extra_replicas(table)
    orders = [np.lexsort((c.layer, -c.sgain, -c.prio)) for c in pools]  # best first; stable: generation order
    while len(chosen) < max_ops:
        best: tuple[float, int, int, int, int] | None = None
        for pi, (c, order) in enumerate(zip(pools, orders, strict=True)):
            pend = c.status[order] == PENDING
            if pend.any():
                k = int(order[int(np.argmax(pend))])
                key = (-float(c.prio[k]), -int(c.sgain[k]), int(c.layer[k]), pi, k)
                best = key if best is None or key < best else best
        if best is None:
            break
        c, k = pools[best[3]], best[4]
        d_rep = 1 if c.kind[k] == REPLICATE else 0
        if c.kind[k] >= CONS_REPLICATE:
            d_rep += (1 if c.kind[k] == CONS_REPLICATE else 0) - (int(st.cnt[c.layer[k], c.victim[k]]) - 1)
        if spent + float(c.cost[k]) > cost.budget_s:
            c.status[k] = _code(Reason.OVER_BUDGET)
            continue
        if cost.replica_budget is not None and d_rep > 0 and replicas + d_rep > cost.replica_budget:
            c.status[k] = _code(Reason.OVER_REPLICA_BUDGET)
            continue
        c.status[k] = CHOSEN
        spent += float(c.cost[k])
        replicas += d_rep
        chosen.append((c, k))
        layer = int(c.layer[k])
        for p in pools:
            p.status[(p.layer == layer) & (p.status != CHOSEN)] = _code(Reason.SUPERSEDED)
        st.apply(c, k)
        if len(chosen) < max_ops:  # re-plan the layer (after the last pick nothing would use it)
            pools.append(st.generate(np.array([layer], dtype=np.int64), refused))
            orders.append(np.lexsort((pools[-1].layer, -pools[-1].sgain, -pools[-1].prio)))
    ops: list[Operation] = []
    op_layers: list[int] = []
    for c, k in chosen:
        these = _ops_of(c, k)
        ops += these
        op_layers += [int(c.layer[k])] * len(these)
    lg = tuple((lay, float(st.obj0[lay] - st.obj[lay]) / st.base) for lay in sorted(set(op_layers)))
    return Plan(tuple(ops), tuple(op_layers), (st.base - int(st.obj.sum())) / st.base, spent,
                tuple(refused.values()) + _refusals(pools, chosen, st.base), lg)


def _refusals(pools: list[_Cands], chosen: list[tuple[_Cands, int]], base: int) -> tuple[Refused, ...]:
    """One Refused per distinct candidate not chosen, with its last status (a layer re-planned after a pick
    regenerates some candidates). Deduplicated on integer keys before any object is built."""
    for c in pools:
        c.status[c.status == PENDING] = _code(Reason.MAX_OPS)
    cols = [np.concatenate([getattr(c, f) for c in pools]) for f in ("layer", "kind", "expert", "src", "dst",
                                                                         "victim", "vdst", "status", "gain")]
    cost = np.concatenate([c.cost for c in pools])
    layer, kind, expert, src, dst, vic, vdst, status, gain = cols
    src = np.where(kind % 2 == 0, -1, src)  # a replication does not name its source
    keys = np.stack([layer, kind, expert, src, dst, vic, vdst], axis=1)
    offsets = np.cumsum([0] + [p.layer.size for p in pools])
    chosen_rows = {int(offsets[next(i for i, p in enumerate(pools) if p is c)]) + k for c, k in chosen}
    # only a re-planned (chosen) layer has candidates generated twice: keep each key's last occurrence
    replanned = np.isin(layer, [int(c.layer[k]) for c, k in chosen])
    keep = np.ones(layer.size, dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for r in np.flatnonzero(replanned)[::-1].tolist():
        key = tuple(keys[r].tolist())
        keep[r] = key not in seen and r not in chosen_rows
        seen.add(key)
    chosen_keys = {tuple(keys[r].tolist()) for r in chosen_rows}
    # an op in the plan is not listed as refused (integer keys: no dataclass hashing per candidate)
    chosen_main = {(int(c.layer[k]), int(c.kind[k]) % 2, int(c.expert[k]),
                    -1 if c.kind[k] % 2 == 0 else int(c.src[k]), int(c.dst[k])) for c, k in chosen}
    idx = np.flatnonzero(keep & (status != CHOSEN))
    out: list[Refused] = []
    rows = keys[idx].tolist()
    for (lay, kd, e, s_, d, v, vd), st_, g, cs in zip(rows, status[idx].tolist(), gain[idx].tolist(),
                                                      cost[idx].tolist(), strict=True):
        if (lay, kd, e, s_, d, v, vd) in chosen_keys:
            continue
        if (lay, kd % 2, e, s_, d) in chosen_main:
            continue
        main: Operation = Replicate(lay, e, d) if kd % 2 == 0 else Migrate(lay, e, s_, d)
        detail = f"after consolidate L{lay} E[{v}] -> r{vd}" if kd >= CONS_REPLICATE else ""
        out.append(Refused(main, _REASON_TEXT[st_ - 2], g / base, cs, detail))
    return tuple(out)
