"""Work for a restored rank: a rank comes back to service with empty slots (elastic.plan_restore), and the
node that restored it then proposes experts for it at once, instead of leaving it idle until some later
rebalance.

`fill` is that proposal: a rebalance planned on the replay windows from the table with the rank back (the
empty rank is the coolest, so the planner moves load onto it), verified by replay layer by layer and gated by
the copy budget as `decision.rebalance` is, by a gain >= 0 rather than tau (the copies use capacity that
stands idle otherwise); then, in every layer where the rank still holds nothing, its even share of the
layer's experts by slot count (`plan_fill`), kept where replay shows the layer no worse. With no load yet (an
empty buffer) the slot-count share is all there is, with nothing to replay it on. It is the second half of
the restore, so its kind is the restore's ("manual"), not forced: every voter re-verifies it by its own replay
(no worse, and within verify_tolerance of the proposer's gain, as for any plan not forced); like an operator's
change it is not observed for a rollback, and tau does not gate it (replay must only show it no worse,
DESIGN's I6).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from controlplane.cost import change_cost
from controlplane.decision import Attempt, Decision, DecisionOutcome, rebalance
from controlplane.monitor import ReplayBuffer
from controlplane.ops import Migrate, Operation, apply_ops
from controlplane.params import DecisionParams
from controlplane.planner import Reason, Refused
from controlplane.table import RoutingTable, check_no_new_rank_duplicates
from controlplane.verify import gain, layer_gains

FILL_TRIES = 3  # fills proposed for one restore: one that loses its version to another table is planned again


def plan_fill(table: RoutingTable, ranks: Sequence[int], load: npt.NDArray[np.integer] | None = None
              ) -> tuple[Operation, ...]:
    """Migrations that give each of `ranks` (active) its even share of every layer where it holds no expert:
    occupied slots over active ranks, rounded down (at most its slots). Each comes from the active rank
    holding the most experts (ties: the most loaded under `load` [L, E], then the lowest id) while that
    rank holds at least two more than the filled one: its expert with the most tokens per replica that
    leaves the filled rank below the donor, else its coolest (ties: the lowest expert id). Deterministic."""
    topo = table.topology
    S, G, L, E = topo.slots_per_rank, topo.ranks, table.layers, table.experts
    phy = table.phy2log.reshape(L, G, S).copy()
    active = list(table.active_ranks)
    filled = {int(r) for r in ranks}
    x = np.zeros((L, E)) if load is None else np.asarray(load, dtype=np.float64)
    ops: list[Operation] = []
    for lay in range(L):
        empty = [r for r in sorted(filled) if r in active and (phy[lay, r] < 0).all()]
        if not empty:
            continue
        row = phy[lay]
        occupied = (row >= 0).sum(axis=1)
        share = min(S, int(occupied[active].sum()) // len(active))
        held = row[row >= 0]
        per = x[lay] / np.maximum(np.bincount(held, minlength=E), 1)  # tokens per replica [E]
        rank_load = np.array([per[row[g][row[g] >= 0]].sum() for g in range(G)])
        for r in empty:
            while occupied[r] < share:
                donors = [g for g in active if g not in filled and occupied[g] >= occupied[r] + 2
                          and any(e >= 0 and e not in row[r] for e in row[g])]
                if not donors:
                    break
                donor = max(donors, key=lambda g: (int(occupied[g]), float(rank_load[g]), -g))
                cands = sorted({int(e) for e in row[donor] if e >= 0 and e not in row[r]})
                fits = [e for e in cands if rank_load[r] + per[e] <= rank_load[donor] - per[e]]
                e = (max(fits, key=lambda e: (float(per[e]), -e)) if fits
                     else min(cands, key=lambda e: (float(per[e]), e)))
                row[donor, int(np.flatnonzero(row[donor] == e)[0])] = -1
                row[r, int(np.flatnonzero(row[r] < 0)[0])] = e
                occupied[donor] -= 1
                occupied[r] += 1
                rank_load[donor] -= per[e]
                rank_load[r] += per[e]
                ops.append(Migrate(lay, e, donor, r))
    return tuple(ops)


def fill(head: RoutingTable, ranks: Sequence[int], buf: ReplayBuffer, p: DecisionParams,
         cooldown: npt.NDArray[np.bool_], trigger: str) -> Attempt:
    """Experts for `ranks`, restored in `head` (module docstring): the Attempt to propose, or None and why."""
    planned: tuple[Operation, ...] = ()
    refused: list[Refused] = []
    est = 0.0
    k = buf.same_mix(p.drift_tv) if buf.steps else 0
    if buf.steps:
        a = rebalance(head, buf, p, None, cooldown, trigger, floor=0.0)
        refused += a.refused
        if a.decision is not None:
            planned, est, trigger = a.decision.ops, a.decision.estimated_gain, a.decision.trigger
    base = apply_ops(head, planned) if planned else head
    extra = plan_fill(base, ranks, buf.window_totals(k).sum(axis=0) if buf.steps else None)
    if extra and buf.steps:  # replayed layer by layer: a layer the share makes worse keeps the rank empty
        ls = np.unique([o.layer for o in extra if isinstance(o, Migrate)]).astype(np.int64)
        lg = layer_gains(buf.stats(base, last=k), buf.stats(apply_ops(base, extra), base=base, last=k), ls)
        worse = {int(lay): float(g) for lay, g in zip(ls.tolist(), lg.tolist(), strict=True) if g < 0}
        refused += [Refused(o, Reason.VERIFY_NO_GAIN.value, worse[o.layer], 0.0,
                            f"restored rank's share of layer {o.layer} replays worse")
                    for o in extra if isinstance(o, Migrate) and o.layer in worse]
        extra = tuple(o for o in extra if isinstance(o, Migrate) and o.layer not in worse)
    ops = (*planned, *extra)
    if not ops:
        return Attempt(None, DecisionOutcome.NO_PLAN, f"nothing to move onto ranks {list(ranks)}: no plan gains "
                       f"and no layer has experts to spare", tuple(refused))
    table = apply_ops(head, ops)
    table.validate()  # a defect here is a bug: fail loudly
    check_no_new_rank_duplicates(head, table)
    vg = gain(buf.stats(head, last=k), buf.stats(table, base=head, last=k)) if buf.steps else 0.0
    cost = change_cost(p.cost_model(len(head.active_ranks)), head, table, buf.tokens_per_step())
    topo = head.topology
    onto = int((table.phy2log.reshape(table.layers, topo.ranks, topo.slots_per_rank)[:, list(ranks)] >= 0).sum())
    how = "planned on the replay windows" if buf.steps else "by slot count: no load window yet"
    trig = f"{trigger}: {onto} experts onto ranks {list(ranks)} ({how})"
    lo, hi = buf.span(k or None)
    d = Decision(table, ops, max(est, vg), vg, cost, trig, tuple(refused), "manual", lo, hi)
    return Attempt(d, DecisionOutcome.PROPOSED, "", tuple(refused), max(est, vg), vg, cost)


def fill_restored(head: RoutingTable, ranks: Sequence[int], restore_version: int, lost: Sequence[int],
                  buf: ReplayBuffer, p: DecisionParams, cooldown: npt.NDArray[np.bool_]) -> Attempt:
    """The controller's fill after its restore of `ranks` committed as `restore_version`: `fill` for those of
    them still empty in some layer of `head`, unless a repair of the `lost` ranks comes first (a later
    rebalance fills them then)."""
    phy = head.phy2log.reshape(head.layers, head.topology.ranks, -1)
    empty = [r for r in ranks if r in head.active_ranks and (phy[:, r] < 0).all(axis=1).any()]
    if not empty:
        return Attempt(None, DecisionOutcome.NO_PLAN, f"ranks {list(ranks)} hold experts in every layer of "
                                                      f"v{head.version}")
    if lost:
        return Attempt(None, DecisionOutcome.NOT_DESIGNATED, f"a repair of ranks {list(lost)} comes first")
    return fill(head, empty, buf, p, cooldown, f"restore: ranks {list(ranks)} restored in v{restore_version}")
