"""Large-gap planning: larger deltas than the greedy planner's, for when the head is far from balanced.

The greedy planner (controlplane.greedy) moves one expert off a layer's hottest rank per round, with a free
slot or a cold second replica's slot as the destination: cheap in bytes, and right for small drift. After a
large drift it stops in a local optimum well above what a re-pack reaches (DeepSeek-V3 decode after a
workload shift, from an EPLB boot: greedy 1.18 x an even split on the replay blocks, a full re-pack 1.03).
This module gives decision.rebalance three per-layer alternatives:

- `repack`: EPLB's replica counts (`replicate_experts` over the active slots) packed longest-first onto the
  least-loaded active rank, slots preserved (vLLM's preserve_intragpu_slots). The balance reference; it
  moves almost every slot (16,000 of 18,560 at DeepSeek-V3 8x8x5);
- `exchange` from the head: moves and swaps between a layer's most loaded rank and any other, each lowering
  that rank's load, keeping the prefix of steps that pays `lam` per changed slot;
- `exchange` from `recount` (the head with EPLB's replica counts: drops and added replicas only).

On that DeepSeek-V3 drift the exchange from the recount reaches 1.026 x an even split (better than the
re-pack) with ~4,500 changed slots. rebalance keeps, per layer, whichever of greedy and these gains the
most net of `min_op_gain` per copied slot, and replays the result step by step before proposing it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from controlplane.baselines.eplb import preserve_slots, replicate_experts
from controlplane.load import rank_load
from controlplane.ops import Drop, Migrate, Operation, Replicate, Swap
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

def repack(head: RoutingTable, weight: F64) -> tuple[I64, npt.NDArray[np.bool_]]:
    """phy2log [L, P] re-packed from `weight` [L, E] (token totals), and ok [L]: False for a layer whose
    packing ran out of room (its row is head's). Vectorised over layers; loops over the active slots."""
    topo = head.topology
    G, S, L, E = topo.ranks, topo.slots_per_rank, head.layers, head.experts
    act = head.active_mask
    A = int(act.sum())
    w = np.asarray(weight, dtype=np.float64) + 1e-9  # cold experts still order deterministically
    _, cnt = replicate_experts(w, min(A * S, A * E), max_replicas=A)  # [L, E]; at most one replica per rank
    item_e = np.stack([np.repeat(np.arange(E), cnt[layer]) for layer in range(L)])  # [L, items]
    item_w = np.take_along_axis(w / cnt, item_e, axis=1)
    order = np.argsort(-item_w, axis=1, kind="stable")
    item_e = np.take_along_axis(item_e, order, axis=1)
    item_w = np.take_along_axis(item_w, order, axis=1)
    rows = np.arange(L)
    load = np.zeros((L, G))
    n = np.where(act, 0, S)[None, :].repeat(L, axis=0)
    has = np.zeros((L, E, G), dtype=bool)
    ok = np.ones(L, dtype=bool)
    for j in range(item_e.shape[1]):
        e = item_e[:, j]
        elig = (n < S) & ~has[rows, e, :]  # [L, G]
        g = np.argmin(np.where(elig, load, np.inf), axis=1)
        live = elig.any(axis=1)
        ok &= live
        r, gg = rows[live], g[live]
        load[r, gg] += item_w[live, j]
        n[r, gg] += 1
        has[r, e[live], gg] = True
    # experts per rank -> [L, G, S] (held experts first, -1 after), then keep each kept expert's slot
    per = has.transpose(0, 2, 1)  # [L, G, E]
    if E < S:  # fewer experts than a rank's slots: pad with never-held columns
        per = np.concatenate([per, np.zeros((L, G, S - E), dtype=bool)], axis=2)
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


def moved_slots(a: RoutingTable, b: RoutingTable) -> I64:
    """[L]: slots of `b` whose expert differs from `a`'s and is not empty (copies to make)."""
    out: I64 = ((a.phy2log != b.phy2log) & (b.phy2log >= 0)).sum(axis=1)
    return out


def ops_to(head: RoutingTable, target: RoutingTable, layers: list[int]) -> list[Operation] | None:
    """Operations that give `head` the experts `target` has on every rank, in the given layers: drops (an
    expert losing replicas), then migrations and replications into free slots, and a swap wherever full
    ranks wait on each other. Applying them to head gives target's rank sets; experts that stay keep their
    slots, unless full ranks wait on each other where no swap fits: then a move goes through a free slot first
    (made, if need be, by dropping a spare replica and copying it back). None if a layer cannot be expressed."""
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
        detours = 0
        active = set(head.active_ranks)  # a drained rank's empty slots are no place to park an expert
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
                         and m1[0] not in have[m1[2]] and (m2[2] == m1[1] or m2[0] not in want[m1[1]])), None)
            if pair is None:
                # no swap fits (it would put a second replica on a rank): route a waiting move through a rank
                # with a free slot, making one if every slot is full by dropping a spare replica of an expert
                # that stays there (copied back once the rank frees up)
                detours += 1
                if detours > 4 * G * S or not _detour(lay, have, want, free, moves, reps, out, active):
                    return None
                continue
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


def _detour(lay: int, have: list[set[int]], want: list[set[int]], free: list[int], moves: list[list[int]],
            reps: list[tuple[int, int]], out: list[Operation], active: set[int]) -> bool:
    """One waiting move of ops_to goes to a rank with a free slot first (it continues from there later); if no
    rank has one, a spare replica (its expert has another) of an expert that rank keeps is dropped to make one,
    and its copy back is queued. False if neither is possible."""
    def fits(b: int) -> list[int] | None:
        if b not in active:
            return None
        return next((m for m in moves if m[1] != b and m[0] not in have[b] and m[0] not in want[b]), None)

    G = len(have)
    b = next((g for g in range(G) if free[g] > 0 and fits(g) is not None), None)
    if b is None:
        b = _spare_slot(lay, have, want, free, reps, out, fits)
    m = fits(b) if b is not None else None
    if b is None or m is None:
        return False
    e, src, _ = m
    out.append(Migrate(lay, e, src, b))
    have[src].discard(e)
    have[b].add(e)
    free[src] += 1
    free[b] -= 1
    m[1] = b
    return True


def _spare_slot(lay: int, have: list[set[int]], want: list[set[int]], free: list[int], reps: list[tuple[int, int]],
                out: list[Operation], fits: Callable[[int], list[int] | None]) -> int | None:
    """A rank made to have a free slot that a waiting move fits: a spare replica of an expert it keeps is
    dropped there (and queued to be copied back). None if there is none."""
    count: dict[int, int] = {}
    for h in have:
        for e in h:
            count[e] = count.get(e, 0) + 1
    for g in range(len(have)):
        spare = next((e for e in sorted(have[g] & want[g]) if count[e] >= 2), None)
        if spare is not None and fits(g) is not None:
            out.append(Drop(lay, spare, g))
            have[g].discard(spare)
            free[g] += 1
            reps.append((spare, g))
            return g
    return None


def _loads(hold: npt.NDArray[np.bool_], w: F64, cnt: I64) -> F64:
    """[G] load per rank when each expert's weight `w` [E] splits evenly over its `cnt` holders `hold` [E, G]."""
    out: F64 = (hold * (w / np.maximum(cnt, 1))[:, None]).sum(axis=0)
    return out


def recount(head: RoutingTable, weight: F64) -> tuple[I64, dict[int, list[Operation]]]:
    """phy2log [L, P]: head with each expert's replica count moved to EPLB's (`replicate_experts` over the
    active slots) and nothing else moved: surplus replicas leave the most loaded ranks holding them (a drop
    copies nothing), missing ones go to the least loaded active rank with a free slot that lacks the expert
    (heaviest per replica first; one copy each). Also returns each changed layer's operations, in order."""
    topo = head.topology
    G, S, L = topo.ranks, topo.slots_per_rank, head.layers
    act = head.active_mask
    w = np.asarray(weight, dtype=np.float64) + 1e-9
    A = int(act.sum())
    _, want = replicate_experts(w, min(A * S, A * head.experts), max_replicas=A)
    have = head.logcnt
    phy = head.phy2log.reshape(L, G, S).copy()
    ops: dict[int, list[Operation]] = {}
    for lay in np.flatnonzero((want != have).any(axis=1)).tolist():
        rows = phy[lay].tolist()
        ops[lay] = _recount_layer(lay, rows, w[lay], want[lay], have[lay], head.holders[lay], act)
        phy[lay] = rows
    out: I64 = phy.reshape(L, G * S)
    return out, ops


def _recount_layer(lay: int, rows: list[list[int]], w: F64, want: I64, have: I64, hold: npt.NDArray[np.bool_],
                   act: npt.NDArray[np.bool_]) -> list[Operation]:
    """`recount` of one layer, on its slots `rows` [G][S] in place; the operations, in order. One replica at a
    time, so plain Python lists: numpy calls on a few slots cost more than the work. The ranks' loads are kept
    up to date as replicas come and go (a move changes one expert's shares only)."""
    wl, wants, cnt = w.tolist(), want.tolist(), have.tolist()
    ld = _loads(hold, w, have).tolist()
    holders: dict[int, set[int]] = {}
    lops: list[Operation] = []

    def held(e: int) -> set[int]:
        if e not in holders:
            holders[e] = set(np.flatnonzero(hold[e]).tolist())
        return holders[e]

    def reshare(e: int, step: int, g: int) -> None:
        """Expert e gains (step 1) or loses (-1) its replica on rank g: every holder's share changes."""
        hs = held(e)
        for h in hs:
            ld[h] -= wl[e] / max(cnt[e], 1)
        if step > 0:
            hs.add(g)
        else:
            hs.discard(g)
        cnt[e] += step
        for h in hs:
            ld[h] += wl[e] / max(cnt[e], 1)

    for e in [e for e in range(len(cnt)) if cnt[e] > wants[e]]:
        while cnt[e] > wants[e]:
            g = max(held(e), key=lambda h: (ld[h], -h))  # the most loaded holder (lowest rank on ties)
            rows[g][rows[g].index(e)] = -1
            reshare(e, -1, g)
            lops.append(Drop(lay, e, g))
    open_ranks = [g for g in range(len(rows)) if act[g] and -1 in rows[g]]
    add = np.array([e for e in range(len(cnt)) if cnt[e] < wants[e]], dtype=np.int64)
    for e in add[np.argsort(-(w[add] / want[add]), kind="stable")].tolist():
        while cnt[e] < wants[e]:
            hs = held(e)
            room = [(ld[g], g) for g in open_ranks if g not in hs]
            if not room:
                break
            g = min(room)[1]  # the least loaded rank with room (lowest rank on ties)
            rows[g][rows[g].index(-1)] = e
            if -1 not in rows[g]:
                open_ranks.remove(g)
            reshare(e, 1, g)
            lops.append(Replicate(lay, e, g))
    return lops


def exchange(head: RoutingTable, start: tuple[I64, dict[int, list[Operation]]], weight: F64, lam: F64,
             max_steps: int = 4000) -> tuple[I64, dict[int, list[Operation]]]:
    """phy2log [L, P]: from `start` (head, or head recounted), repeatedly move or swap one replica between
    a layer's most loaded active rank and another active rank (an empty slot there makes it a move) so that
    the larger of the two loads is as small as possible, while that lowers the layer's max load (on the
    totals `weight`). Each layer then keeps the prefix of its steps that maximises the lowered max load
    minus lam[layer] per slot that differs from head: the byte-aware local search that a full re-pack is
    not (EPLB's packing moves almost every slot; this keeps what sits well). `start` is a placement and the
    operations that reach it from head; returns the same for the result (each step a Migrate into an empty
    slot or a Swap, valid in order by construction). Every layer's search is its own; they run side by side, one step of
    every still-improving layer per round, vectorised over layers (the same steps, in the same order, as one
    layer at a time)."""
    topo = head.topology
    G, S, L, E = topo.ranks, topo.slots_per_rank, head.layers, head.experts
    act = head.active_mask
    out = start[0].reshape(L, G, S).copy()
    ops = {lay: list(o) for lay, o in start[1].items()}
    ok_slot = out >= 0
    safe = np.maximum(out, 0)
    cnt = np.zeros((L, E), dtype=np.int64)  # replicas per expert
    li, gi, si = np.nonzero(ok_slot)
    np.add.at(cnt, (li, out[li, gi, si]), 1)
    w = np.take_along_axis(np.asarray(weight, dtype=np.float64), safe.reshape(L, -1), axis=1).reshape(L, G, S)
    c = np.take_along_axis(cnt, safe.reshape(L, -1), axis=1).reshape(L, G, S)
    pw = np.where(ok_slot, w / np.maximum(c, 1), 0.0)
    pw[:, ~act] = 0.0
    hold = np.zeros((L, E + 1, G), dtype=bool)  # row E: the empty slot, held nowhere
    hold[li, out[li, gi, si], gi] = True
    hh = np.concatenate([head.holders, np.zeros((L, 1, G), dtype=bool)], axis=1)
    moved = (hold[:, :E] & ~hh[:, :E]).sum(axis=(1, 2)).astype(np.int64)
    load = np.where(act[None, :], pw.sum(axis=2), -np.inf)
    top0 = load.max(axis=1)
    best_v = np.zeros(L)
    best_k = np.zeros(L, dtype=np.int64)
    nsteps = np.zeros(L, dtype=np.int64)
    rounds: list[tuple[I64, ...]] = []  # per round, the steps taken: (layer, h, slot on h, g, slot on g, e, e')
    inact = ~act
    live = np.arange(L)
    lamv = np.asarray(lam, dtype=np.float64)
    for _ in range(max_steps):
        if live.size == 0:
            break
        n = live.size
        ar = np.arange(n)
        ld = load[live]
        h = ld.argmax(axis=1)
        lh = ld[ar, h]
        row = out[live]  # [n, G, S]
        a = row[ar, h]  # [n, S]
        p = pw[live]
        pa = p[ar, h]  # [n, S]
        # [n, S, G]: slot a of h may go to rank g (active, not h, not holding a already)
        ag = hold[live[:, None], np.where(a >= 0, a, E)]
        ag |= inact
        ag[ar, :, h] = True
        ag |= (a < 0)[:, :, None]
        # [n, G, S]: what slot b of g holds may go to h (h does not hold it already; an empty slot may)
        gb = hold[live[:, None, None], np.where(row >= 0, row, E), h[:, None, None]]
        d = pa[:, :, None, None] - p[:, None, :, :]  # [n, S, G, S]
        newmax = ld[:, None, :, None] + d
        np.maximum(newmax, lh[:, None, None, None] - d, out=newmax)
        bad = d <= 0
        bad |= ag[:, :, :, None]
        bad |= gb[:, None, :, :]
        np.copyto(newmax, np.inf, where=bad)
        score = newmax.reshape(n, -1)
        k = score.argmin(axis=1)
        go = score[ar, k] < lh - 1e-9
        live, h, k, lh = live[go], h[go], k[go], lh[go]
        if live.size == 0:
            break
        ai, g, bi = np.unravel_index(k, (S, G, S))
        ea = out[live, h, ai]
        eb0 = out[live, g, bi]
        eb = np.where(eb0 >= 0, eb0, E)
        moved[live] += ((~hh[live, ea, g]).astype(np.int64) - (~hh[live, ea, h]) + (~hh[live, eb, h])
                        - (~hh[live, eb, g]))
        hold[live, ea, h] = False
        hold[live, ea, g] = True
        full = eb < E
        hold[live[full], eb[full], g[full]] = False
        hold[live[full], eb[full], h[full]] = True
        out[live, h, ai], out[live, g, bi] = eb0, ea
        x, y = pw[live, h, ai], pw[live, g, bi]
        pw[live, h, ai], pw[live, g, bi] = y, x
        load[live, h] = pw[live, h].sum(axis=1)
        load[live, g] = pw[live, g].sum(axis=1)
        v = (top0[live] - load[live].max(axis=1)) - lamv[live] * moved[live]
        nsteps[live] += 1
        up = v > best_v[live] + 1e-9
        best_v[live[up]] = v[up]
        best_k[live[up]] = nsteps[live[up]]
        rounds.append((live, h, ai, g, bi, ea, eb0))
    if rounds:
        cols = [np.concatenate(c) for c in zip(*rounds, strict=True)]
        order = np.argsort(cols[0], kind="stable")  # by layer, each layer's steps in the order taken
        cols = [col[order] for col in cols]
        h_s, ai_s, g_s, bi_s, ea_s, eb_s = (col.tolist() for col in cols[1:])
        starts = np.searchsorted(cols[0], np.arange(L + 1)).tolist()  # layer lay's steps: starts[lay]:starts[lay+1]
        for lay in range(L):
            lo, hi = starts[lay], starts[lay + 1]
            if lo == hi:
                continue
            bk = lo + int(best_k[lay])
            row = out[lay]
            for j in range(hi - 1, bk - 1, -1):
                hh_, ai_, g_, bi_ = h_s[j], ai_s[j], g_s[j], bi_s[j]
                row[hh_, ai_], row[g_, bi_] = row[g_, bi_], row[hh_, ai_]
            if bk > lo:
                ops.setdefault(lay, []).extend(Migrate(lay, ea_s[j], h_s[j], g_s[j]) if eb_s[j] < 0
                                               else Swap(lay, ea_s[j], h_s[j], eb_s[j], g_s[j]) for j in range(lo, bk))
    res: I64 = out.reshape(L, G * S)
    return res, ops
