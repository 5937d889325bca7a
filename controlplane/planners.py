"""The planner interface: what proposes operations for the decision core to verify and gate.

A planner turns the head and the replay blocks into a `Plan` (operations, the layer of each, their estimated
gain and cost); `decision.rebalance` then replays it step by step, drops the layers that do not gain, and
gates the rest by tau and the copy budget, whoever planned it. One is chosen by name
(`DecisionParams.planner`, agent config `decision.planner`):
- "greedy" (the default): the incremental greedy of controlplane.planner, widened to a re-pack or an exchange
  search where the gap to an even split is large (`widen`), or, more sparingly, above a smaller gap
  (`polish_theta`: each copied slot then counts `polish_lam` times); a plan that still leaves a large gap is
  planned once more from its own table;
- "craft": CRAFT as published (controlplane.baselines.craft): per layer, a multiple-choice knapsack over
  replica counts within the same slot budget, capacity-aware placement on top of one copy of every expert,
  reached from the head by controlplane.retarget.ops_to. It re-plans every replica each time, so the copy
  budget decides how much of it goes through.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from controlplane import retarget
from controlplane.cost import CostModel, change_cost, layer_costs
from controlplane.errors import InvalidOperation
from controlplane.ops import Operation, apply_ops
from controlplane.planner import Plan, plan
from controlplane.profile import StabilityProfile
from controlplane.table import RoutingTable


@dataclass(frozen=True)
class PlanKnobs:
    """The decision core's knobs a planner uses (controlplane.params.DecisionParams.knobs)."""

    max_ops: int       # moves per plan, a bound
    tau: float         # the gain a plan must verify
    op_gain: float     # what each copy must gain of its own layer's objective
    fast_theta: float  # a gap to an even split this large lets the greedy planner widen (re-pack, exchange)
    widen: bool        # whether it may
    polish_theta: float = 0.0  # a smaller gap above which it still widens, copies charged more (0: never)
    polish_lam: float = 1.0    # ... charging each copied slot this many times op_gain
    polish_priced: bool = False  # whether that charge is a copy's serving time (DecisionParams.polish_charge)


@dataclass(frozen=True)
class PlanInput:
    """What every planner sees: block totals `X` [B, L, E] of the replay windows that share the latest expert
    mix (`steps` steps in all), the experts in cooldown [L, E], the stability profile (or None), and the
    tokens per step [L, E] that weigh a copy's cost."""

    X: npt.NDArray[np.integer]
    steps: int
    cooldown: npt.NDArray[np.bool_]
    profile: StabilityProfile | None
    tokens_per_step: npt.NDArray[np.float64]


class Planner(Protocol):
    def __call__(self, head: RoutingTable, inp: PlanInput, cost: CostModel, k: PlanKnobs) -> Plan:
        """Operations for `head` (none: nothing worth doing), each layer's share of the estimated gain."""
        ...


def greedy(head: RoutingTable, inp: PlanInput, cost: CostModel, k: PlanKnobs) -> Plan:
    """The incremental greedy (controlplane.planner.plan), widened where the gap is large (`widen`) and, where
    the gap is above polish_theta, with each copied slot charged polish_lam x op_gain (one move at a time may
    get only part of the way: every move off the hottest rank raises another to the max, and a full rank needs
    a swap). A plan that still leaves a large gap is planned once more from its own table, within what is left
    of the copy budget: one plan, both passes' operations in order."""
    pl = plan(head, inp.X, inp.steps, cost, k.max_ops, k.tau, inp.profile, inp.cooldown, k.op_gain)
    if not (k.widen and inp.X.shape[0]):
        return pl
    pl = widen(head, inp.X, pl, k, inp.cooldown, cost, inp.tokens_per_step)
    if not pl.ops:
        return pl
    # a plan that still leaves a large gap (each copy is charged pro rata of the head's objective, so at a
    # large breach a layer may keep its greedy moves): plan once more from the planned table, in the same
    # decision, instead of a window and an observation later
    mid = pl.table if pl.table is not None else apply_ops(head, pl.ops)
    om = retarget.layer_objective(mid, inp.X).astype(np.float64)
    floor = float(_even_split(head, inp.X).sum())
    left = cost.budget_s - pl.cost
    if om.sum() < k.fast_theta * floor or left <= 0:
        return pl
    cm2 = replace(cost, budget_s=left)
    p2 = plan(mid, inp.X, inp.steps, cm2, k.max_ops, k.tau, inp.profile, inp.cooldown, k.op_gain)
    p2 = widen(mid, inp.X, p2, k, inp.cooldown, cm2, inp.tokens_per_step)
    if not p2.ops:
        return pl
    final = head.successor((p2.table if p2.table is not None else apply_ops(mid, p2.ops)).phy2log)
    # the second pass costed its copies from the planned table; the change is from the head (other sources, other
    # links): over the budget as a whole, the first pass stands
    total = change_cost(cost, head, final, inp.tokens_per_step)
    if total > cost.budget_s:
        return pl
    o0 = retarget.layer_objective(head, inp.X).astype(np.float64)
    of = retarget.layer_objective(final, inp.X).astype(np.float64)
    base = float(o0.sum())
    layers = sorted(set(pl.op_layers) | set(p2.op_layers))
    note = f"{pl.note or 'greedy'}; then, still {om.sum() / floor:.3f} x an even split, {p2.note or 'greedy'}"
    return Plan(pl.ops + p2.ops, pl.op_layers + p2.op_layers, float(o0.sum() - of.sum()) / base,
                total, pl.refused + p2.refused,
                tuple((lay, float(o0[lay] - of[lay]) / base) for lay in layers), note, final)


def craft(head: RoutingTable, inp: PlanInput, cost: CostModel, k: PlanKnobs) -> Plan:
    """CRAFT's placement for the replay blocks, reached from the head layer by layer (module docstring)."""
    from controlplane.baselines.craft import craft_table

    base = head.successor(_one_copy_each(head))
    target = craft_table(base, np.asarray(inp.X))
    o0 = retarget.layer_objective(head, inp.X).astype(np.float64)
    ot = retarget.layer_objective(target, inp.X).astype(np.float64)
    layers = [lay for lay in range(head.layers) if ot[lay] < o0[lay] and not inp.cooldown[lay].any()]
    ops: list[Operation] = []
    op_layers: list[int] = []
    for lay in layers:
        lops = retarget.ops_to(head, target, [lay])
        if lops:
            ops += lops
            op_layers += [lay] * len(lops)
    if not ops:
        return Plan((), (), 0.0, 0.0, ())
    total = float(o0.sum())
    done = sorted(set(op_layers))
    planned = apply_ops(head, ops)
    return Plan(tuple(ops), tuple(op_layers), float(sum(o0[lay] - ot[lay] for lay in done)) / total,
                change_cost(cost, head, planned, inp.tokens_per_step), (),
                tuple((lay, float(o0[lay] - ot[lay]) / total) for lay in done), f"CRAFT re-plan of {len(done)} layers")


def _one_copy_each(head: RoutingTable) -> npt.NDArray[np.int64]:
    """The head with every expert's extra replicas dropped (the first slot of each expert kept): CRAFT's static
    placement."""
    phy = np.array(head.phy2log, dtype=np.int64)
    for lay in range(phy.shape[0]):
        seen: set[int] = set()
        for s, e in enumerate(phy[lay].tolist()):
            if e >= 0 and e in seen:
                phy[lay, s] = -1
            seen.add(e)
    return phy


def _even_split(head: RoutingTable, X: npt.NDArray[np.integer]) -> npt.NDArray[np.float64]:
    """[L]: each layer's objective at an even split of every block over the active ranks: what no packing beats."""
    out: npt.NDArray[np.float64] = np.ceil(np.asarray(X, dtype=np.float64).sum(axis=2) / len(head.active_ranks)).sum(axis=0)
    return out


def widen(head: RoutingTable, X: npt.NDArray[np.integer], pl: Plan, p: PlanKnobs,
           cooldown: npt.NDArray[np.bool_], cm: CostModel, tokens: npt.NDArray[np.float64]) -> Plan:
    """The large-gap planner (controlplane.retarget): when the head is more than fast_theta above an even
    split and the greedy plan's result is more than tau above it, a layer may take a full re-pack of the replay
    blocks or an exchange search (from the head, or from the head with EPLB's replica counts) instead of its
    greedy moves: whichever gains the most on X net of `min_op_gain` x its layer objective per copied slot, that
    objective capped at fast_theta x the layer's even split (where the large-gap search starts). Charged at the
    head's own objective, a copy looked dearer the further the head was off: a hottest expert taking 40% of a
    layer (6.7 x an even split) kept an exchange that stopped at 1.27 over the re-pack that reached 1.00, and
    the polish could not close the rest (held-out top-1 of 128, steady: 1.29 for the segment, hindsight 1.13).
    All three are searched whatever the re-pack gives: on 3 slots a rank the exchange search reaches an even
    split where the re-pack does not beat the greedy moves (held-out OLMoE at 4x8: the drift's rest came two
    windows later). Layers switch in order of that net gain per second of copy cost while the plan stays within
    the cost budget; a layer with an expert in cooldown stays greedy. A polish: under fast_theta, where the gap
    is above polish_theta, the same search with each copied slot charged polish_lam times; a greedy plan that
    gains more than tau is weighed against it layer by layer, not taken unseen (it took part of the way and
    the polish came a window later)."""
    L = head.layers
    o0 = retarget.layer_objective(head, X).astype(np.float64)
    # a large gap: the head's objective is above fast_theta x the even split of every block over the active
    # ranks (what no packing beats), and the greedy plan's result more than tau above that split
    per_floor = _even_split(head, X)
    floor = float(per_floor.sum())
    polish = o0.sum() < p.fast_theta * floor
    if polish and not (p.polish_theta and o0.sum() >= p.polish_theta * floor):
        return pl
    lam_x = p.polish_lam if polish else 1.0
    greedy_t = apply_ops(head, pl.ops) if pl.ops else head
    as_greedy = replace(pl, table=greedy_t) if pl.ops else pl  # the greedy plan, with the table built here
    og = retarget.layer_objective(greedy_t, X).astype(np.float64)
    if og.sum() - floor < p.tau * o0.sum():
        return as_greedy
    w = np.asarray(X, dtype=np.float64).sum(axis=0)
    cands = [head.successor(retarget.repack(head, w)[0])]
    objs = [retarget.layer_objective(cands[0], X)]
    # what a copied slot is charged a fraction of: the layer's objective, in the large-gap search no more than at
    # its threshold (fast_theta x the layer's even split), so that a copy does not look dearer the further the
    # head is off; the greedy moves are weighed on the same basis
    base_o = o0 if polish else np.minimum(o0, per_floor * p.fast_theta)
    lam = p.op_gain * lam_x * base_o
    known: dict[int, dict[int, list[Operation]]] = {}  # candidate -> its operations per layer, when it has them
    for start in ((head.phy2log, {}), retarget.recount(head, w)):
        phy, by_layer = retarget.exchange(head, start, w, lam)
        known[len(cands)] = by_layer
        cands.append(head.successor(phy))
    objs += [retarget.layer_objective(t, X) for t in cands[1:]]
    greedy_cost = layer_costs(cm, head, greedy_t, tokens)
    # the greedy moves passed the planner's own charge (op_gain a slot): a polish's surcharge is for the copies
    # it would add, so a greedy layer is weighed at op_gain (else a polish would drop the greedy moves of every
    # layer whose copies do not repay the surcharge, before the cost-benefit test could back off)
    greedy_v = (o0 - og) - p.op_gain * base_o * retarget.moved_slots(head, greedy_t)
    best_v, best_c, best_cost = greedy_v.copy(), np.full(L, -1), greedy_cost.copy()
    for i, (t, obj) in enumerate(zip(cands, objs, strict=True)):
        v = (o0 - obj) - lam * retarget.moved_slots(head, t)
        better = v > best_v + 1e-9
        best_v, best_c = np.where(better, v, best_v), np.where(better, i, best_c)
        best_cost = np.where(better, layer_costs(cm, head, t, tokens), best_cost)
    best_c[cooldown.any(axis=1)] = -1
    what = f"greedy stuck (copies x{lam_x:.3g})" if polish else "large gap"
    if not (best_c >= 0).any() and not pl.ops:  # what the operator is told (explain): why nothing was planned
        rp = int(retarget.moved_slots(head, cands[0]).sum())
        per = float(np.mean(lam / np.maximum(o0, 1e-12)))
        return replace(pl, note=(
            f"{what}: head {o0.sum() / floor:.3f} x an even split, full re-pack {objs[0].sum() / floor:.3f} "
            f"copying {rp} slots; no layer's re-pack or exchange gains its copies' charge ({per:.2%} of its "
            f"layer a copied slot: min_op_gain x {lam_x:.3g}"
            + (", its serving time x decision.polish_lam over the horizon" if polish and p.polish_priced else "") + ")"
            + ("; a lower decision.polish_lam lets such copies through" if polish else "")))
    spent = float(greedy_cost.sum())
    wide: list[int] = []
    extra = best_cost - greedy_cost
    for lay in sorted(np.flatnonzero(best_c >= 0).tolist(),
                      key=lambda j: (-(best_v[j] - greedy_v[j]) / max(float(extra[j]), 1e-12), j)):
        if spent + float(extra[lay]) <= cm.budget_s:
            spent += float(extra[lay])
            wide.append(lay)
    if not wide:
        return as_greedy
    more: list[Operation] = []
    kept = 0  # layers whose greedy moves cost more than they gain: left unchanged (no operation)
    for lay in sorted(wide):
        c = int(best_c[lay])
        lops = known[c].get(lay, []) if c in known else retarget.ops_to(head, cands[c], [lay])
        if lops is None:  # a re-pack its operations cannot reach: the layer keeps its greedy moves
            wide.remove(lay)
            continue
        kept += not lops
        more += lops
    if not wide:
        return as_greedy
    keep = [(o, lay) for o, lay in zip(pl.ops, pl.op_layers, strict=True) if lay not in set(wide)]
    ops = [o for o, _ in keep] + more
    op_layers = [lay for _, lay in keep] + [o.layer for o in more]  # type: ignore[union-attr]
    base = float(o0.sum())
    try:
        planned = apply_ops(head, ops)
    except InvalidOperation:  # a planner defect must not take the controller down: the greedy plan stands
        return as_greedy
    on = retarget.layer_objective(planned, X).astype(np.float64)
    note = (f"{what}: head {o0.sum() / floor:.3f} x an even split, greedy plan {og.sum() / floor:.3f}, full "
            f"re-pack {objs[0].sum() / floor:.3f}; {len(wide) - kept} of {L} layers re-packed ({len(more)} ops)"
            + (f", {kept} left unchanged (their greedy moves dropped)" if kept else "")
            + f", {float(on.sum()) / floor:.3f} planned")
    return Plan(tuple(ops), tuple(op_layers), float(o0.sum() - on.sum()) / base, spent, pl.refused,
                tuple((lay, float(o0[lay] - on[lay]) / base) for lay in sorted(set(op_layers))), note, planned)


PLANNERS: dict[str, Planner] = {"greedy": greedy, "craft": craft}
