"""Estimate, verify, gate: turn a trigger (or an operator, a rollback, a lost rank) into one Decision.

Each function takes the head table and the replay buffer and returns an `Attempt`: the Decision to propose,
or None with a stable outcome code, and everything refused on the way. Gains are relative reductions of the
mean step imbalance on the replay buffer (`verify.gain`); a rebalance is proposed only when its verified gain
is >= tau, replay can tell it from the spread of its rows (`verify.gain_bound` above 0 at `gain_confidence`)
and its cost (`cost.change_cost`: `cost.CostModel` over `table.diff`'s moves) is within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from controlplane import retarget
from controlplane.cost import change_cost
from controlplane.elastic import DrainRefused, plan_repair
from controlplane.errors import InvalidOperation, InvalidTable
from controlplane.monitor import ReplayBuffer
from controlplane.ops import Consolidate, Migrate, Operation, Replicate, apply_ops, describe
from controlplane.params import DecisionParams
from controlplane.planner import Reason, Refused
from controlplane.planners import PLANNERS, PlanInput
from controlplane.profile import StabilityProfile
from controlplane.table import RoutingTable, check_no_new_rank_duplicates
from controlplane.verify import gain, gain_bound, layer_gains, row_gains, verify_windows


@dataclass(frozen=True)
class Decision:
    """One proposed change: a successor of the head (version = head + 1, parent = head), printable."""

    table: RoutingTable
    ops: tuple[Operation, ...]
    estimated_gain: float
    verified_gain: float
    cost: float
    trigger: str
    refused: tuple[Refused, ...]
    kind: str  # "rebalance" | "rollback" | "manual" | "repair"
    replay_from_step: int = 0
    replay_to_step: int = 0
    load_ms: float = 0.0  # the step time its cost-benefit test judged it with (0: none)

    def describe(self) -> str:
        head = (f"v{self.table.version} ({self.kind}) <- v{self.table.parent}: {len(self.ops)} ops, estimated gain "
                f"{self.estimated_gain:.4f}, verified gain {self.verified_gain:.4f}, cost {self.cost * 1e3:.3f} ms")
        lines = [head, f"  trigger: {self.trigger}"] + [f"  + {describe(o)}" for o in self.ops]
        return "\n".join(lines + [f"  ({len(self.refused)} candidates refused)"])


class DecisionOutcome(StrEnum):
    """Every outcome code a decision reports (Attempt.outcome, and the controller's Explain.outcome); a
    refused plan's code is its planner Reason (GAIN_BELOW_TAU, OVER_BUDGET, ...) or the invalid operation's
    or table's own code instead."""

    PROPOSED = "PROPOSED"
    NO_PLAN = "NO_PLAN"  # no candidate paid its way
    NOTHING_TO_REPAIR = "NOTHING_TO_REPAIR"
    ROLLBACK_NOT_BETTER = "ROLLBACK_NOT_BETTER"  # the windows since the change do not favour the parent
    ROLLBACK_NOT_EXPRESSIBLE = "ROLLBACK_NOT_EXPRESSIBLE"
    BELOW_THETA = "BELOW_THETA"  # step imbalance under theta: the error budget holds
    BUDGET_NOT_SPENT = "BUDGET_NOT_SPENT"  # above theta, for fewer than budget_windows windows so far
    PROPOSAL_IN_FLIGHT = "PROPOSAL_IN_FLIGHT"
    PLANNING = "PLANNING"  # this node's plan of an earlier window is still being computed (off the agent's loop)
    STALE_PLAN = "STALE_PLAN"  # a plan computed off the loop came back after its head or the state it needs moved
    PLANNER_ERROR = "PLANNER_ERROR"  # the planner raised (a defect): logged, nothing proposed
    PAUSED = "PAUSED"
    RESUMED = "RESUMED"
    OBSERVING = "OBSERVING"  # the last change is being judged on realised load
    NOT_DESIGNATED = "NOT_DESIGNATED"  # another node plans this window
    COMMITTED = "COMMITTED"
    LOST = "LOST"  # another table won the version
    FAILED = "FAILED"
    STALE_WINDOW = "STALE_WINDOW"
    STALE_FAILURE = "STALE_FAILURE"
    STALE_COMMIT = "STALE_COMMIT"
    PARTIAL_WINDOW = "PARTIAL_WINDOW"  # a window without some node's load (lagging or absent agent): not decided on
    STEP_TIME_WARMING_UP = "STEP_TIME_WARMING_UP"  # the engines measure their steps, too few yet to fit the step
    #                                                time a rebalance is judged with: held (repairs are not)


@dataclass
class Attempt:
    decision: Decision | None
    outcome: str  # a DecisionOutcome, or the code of what refused it
    detail: str = ""
    refused: tuple[Refused, ...] = ()
    estimated_gain: float = 0.0
    verified_gain: float = 0.0
    cost: float = 0.0


def rebalance(head: RoutingTable, buf: ReplayBuffer, p: DecisionParams, profile: StabilityProfile | None,
              cooldown: npt.NDArray[np.bool_], trigger: str, floor: float | None = None) -> Attempt:
    """Plan on the block totals of the windows that share the latest expert mix (`ReplayBuffer.same_mix`:
    after a drift, only the windows since), verify on every step of those windows (of the last two while the mix
    is still moving: `verify.verify_windows`), drop layers that replay
    shows not to gain, gate the rest by tau (or `floor`, the gain a restored rank's fill needs), the cost
    budget and (but for a fill) the cost-benefit test (controlplane.worth)."""
    need = p.tau if floor is None else floor
    cm = p.cost_model(len(head.active_ranks))
    k = buf.same_mix(p.drift_tv)
    kv = verify_windows(buf.window_totals(), p.drift_tv)  # k, or 2 while the mix is still moving
    inp = PlanInput(buf.block_totals(k), buf.steps_of(k), cooldown, profile, buf.tokens_per_step())
    pl = PLANNERS[p.planner](head, inp, cm, p.knobs(head))
    refused = list(pl.refused)
    if not pl.ops:
        why = "no move gains at least min_op_gain" + (f"; {pl.note}" if pl.note else "")
        return Attempt(None, DecisionOutcome.NO_PLAN, why, tuple(refused))
    base = buf.stats(head, last=kv)
    ops, op_layers = list(pl.ops), np.asarray(pl.op_layers, dtype=np.int64)
    table = pl.table if pl.table is not None else apply_ops(head, ops)
    table.validate()  # a planner that builds an invalid table is a bug: fail loudly
    check_no_new_rank_duplicates(head, table)  # ... and so is one that stacks replicas on one rank
    new = buf.stats(table, base=head, last=kv)
    ls = np.unique(op_layers)
    lg = layer_gains(base, new, ls)
    by_layer = {int(lay): float(g) for lay, g in zip(ls.tolist(), lg.tolist(), strict=True)}
    drop = {lay for lay, g in by_layer.items() if g <= 0}
    if drop:
        for o, lay in zip(ops, op_layers.tolist(), strict=True):
            if lay in drop:
                refused.append(Refused(o, Reason.VERIFY_NO_GAIN.value, by_layer[lay], 0.0,
                                       f"layer {lay} replayed step by step"))
        ops = [o for o, lay in zip(ops, op_layers.tolist(), strict=True) if lay not in drop]
        if not ops:
            return Attempt(None, Reason.VERIFY_NO_GAIN.value, "no planned layer gained on replay", tuple(refused))
        ls = np.array(sorted(set(ls.tolist()) - drop), dtype=np.int64)
        table = apply_ops(head, ops)
        new = buf.stats(table, base=head, last=kv)
    vg = gain(base, new)
    rows = row_gains(base, new)
    # a restored rank's fill (floor) asks only that replay shows it no worse: no bound beyond the mean
    # while the mix moves (kv > k), the gain must hold across the windows too, not only across the rows
    blocks = buf.rows_per_window(kv) if kv > k else []
    bound = gain_bound(rows, p.gain_confidence, blocks) if floor is None else vg
    est = sum(g for lay, g in pl.layer_gain if lay in set(ls.tolist()))
    cost = change_cost(cm, head, table, buf.tokens_per_step())
    a = Attempt(None, "", "", (), est, vg, cost)
    w, ranks = p.worth(), len(head.active_ranks)
    pays = not w.enabled or floor is not None or w.repays(vg, cost, ranks)  # a restored rank's fill: no horizon test
    noisy = floor is None and p.gain_confidence > 0.5 and bound <= 0.0
    if vg < need or noisy or cost > cm.budget_s or not pays:
        reason = (Reason.GAIN_BELOW_TAU if vg < need else Reason.GAIN_NOT_SIGNIFICANT if noisy
                  else Reason.OVER_BUDGET if cost > cm.budget_s else Reason.NOT_WORTH)
        refused += [Refused(o, reason.value, by_layer[lay], 0.0, "plan refused as a whole (gain: its layer's share)")
                    for o, lay in zip(ops, [lay for lay in op_layers.tolist() if lay not in drop], strict=True)]
        detail = (w.explain(vg, cost, ranks) if reason is Reason.NOT_WORTH else
                  significance(vg, rows, bound, p.gain_confidence) if reason is Reason.GAIN_NOT_SIGNIFICANT else
                  f"verified gain {vg:.4f} vs tau {need}, cost {cost * 1e3:.3f} ms vs {cm.budget_s * 1e3:.1f} ms")
        refused.append(Refused(None, reason.value, vg, cost, detail))
        a.outcome, a.detail, a.refused = reason.value, refused[-1].detail, tuple(refused)
        return a
    lo, hi = buf.span(kv)
    if pl.note:
        trigger = f"{trigger}; {pl.note}"
    if w.enabled and w.source:  # which step time judged it, and where it came from (controlplane.steptime)
        trigger = f"{trigger}; step time {w.load_ms:.4g} ms, {w.source}"
    a.decision = Decision(table, tuple(ops), est, vg, cost, trigger, tuple(refused), "rebalance", lo, hi,
                          w.load_ms if w.enabled else 0.0)
    a.outcome, a.refused = DecisionOutcome.PROPOSED, tuple(refused)
    return a


def significance(vg: float, rows: npt.NDArray[np.float64], bound: float, confidence: float) -> str:
    """Why a gain is not told from the replay's noise, in figures (GAIN_NOT_SIGNIFICANT's detail)."""
    sd = float(np.std(rows, ddof=1)) if rows.size > 1 else 0.0
    worst = float(rows.min()) if rows.size else 0.0
    return (f"verified gain {vg:.4f} over {rows.size} replay rows (spread {sd:.4f}, worst {worst:+.4f}): its "
            f"{confidence:g} lower bound {bound:+.4f} is not above 0")


def manual(head: RoutingTable, buf: ReplayBuffer, p: DecisionParams, ops: tuple[Operation, ...], force: bool,
           why: str = "") -> Attempt:
    """An operator's operations (or, with `why`, the agent's own on the operator's path): valid always required;
    gain >= tau and the budget unless forced."""
    try:
        table = apply_ops(head, ops)
        table.validate()
    except (InvalidOperation, InvalidTable) as e:
        code = e.reason if isinstance(e, InvalidOperation) else e.code
        return Attempt(None, code, e.message, (Refused(None, code, 0.0, 0.0, e.message),))
    vg = gain(buf.stats(head), buf.stats(table, base=head)) if buf.steps else 0.0
    cm = p.cost_model()
    cost = change_cost(cm, head, table, buf.tokens_per_step())
    if not force and (vg < p.tau or cost > cm.budget_s):
        code = Reason.GAIN_BELOW_TAU.value if vg < p.tau else Reason.OVER_BUDGET.value
        return Attempt(None, code, "use force to propose anyway", (Refused(None, code, vg, cost),), 0.0, vg, cost)
    lo, hi = buf.span()
    who = why or f"operator proposal{' (forced)' if force else ''}"
    trig = f"manual: {who}: " + "; ".join(describe(o) for o in ops)
    return Attempt(Decision(table, tuple(ops), vg, vg, cost, trig, (), "manual", lo, hi), DecisionOutcome.PROPOSED, "", (), vg, vg, cost)


def rollback_ops(head: RoutingTable, target: RoutingTable) -> tuple[Operation, ...]:
    """Operations that give `head` the same experts on every rank as `target` (slots may differ):
    consolidations first, then migrations, then replications, so that freed slots are there when needed."""
    S, G = head.topology.slots_per_rank, head.topology.ranks
    cons: list[Operation] = []
    migs: list[Operation] = []
    reps: list[Operation] = []
    for lay in np.flatnonzero((head.phy2log != target.phy2log).any(axis=1)).tolist():
        have = np.zeros((head.experts, G), dtype=bool)
        want = np.zeros((head.experts, G), dtype=bool)
        for t, m in ((head, have), (target, want)):
            p = t.phy2log[lay]
            m[p[p >= 0], np.flatnonzero(p >= 0) // S] = True
        for e in np.flatnonzero((have != want).any(axis=1)).tolist():
            h, w = set(np.flatnonzero(have[e]).tolist()), set(np.flatnonzero(want[e]).tolist())
            if len(w) < len(h):  # shrink to one replica that stays, then copy the others back
                anchor = min(h & w) if h & w else min(w)
                cons.append(Consolidate(lay, (e,), anchor))
                h = {anchor}
            rem, add = sorted(h - w), sorted(w - h)
            migs += [Migrate(lay, e, s, d) for s, d in zip(rem, add, strict=False)]
            reps += [Replicate(lay, e, d) for d in add[len(rem):]]
    return tuple(cons + migs + reps)


def _fitting_order(head: RoutingTable, ops: tuple[Operation, ...]) -> tuple[Operation, ...] | None:
    """`ops` in their given order where possible, else the first that applies next, repeatedly."""
    try:
        apply_ops(head, ops)
        return ops
    except InvalidOperation:
        pass
    cur, pending, done = head, list(ops), []
    while pending:
        for i, op in enumerate(pending):
            try:
                cur = apply_ops(cur, [op])
            except InvalidOperation:
                continue
            done.append(pending.pop(i))
            break
        else:
            return None
    return tuple(done)


def same_ranks(a: RoutingTable, b: RoutingTable) -> bool:
    """Every rank holds the same experts in every layer (slot positions aside)."""
    G, S = a.topology.ranks, a.topology.slots_per_rank
    pa, pb = (np.sort(t.phy2log.reshape(t.layers, G, S), axis=2) for t in (a, b))
    return a.active_ranks == b.active_ranks and bool(np.array_equal(pa, pb))


def rollback(head: RoutingTable, target: RoutingTable, buf: ReplayBuffer, p: DecisionParams, trigger: str,
             last: int | None = None) -> Attempt:
    """Return to `target`'s placement (the parent of a change that did not help); gated by gain >= 0 on the
    last `last` windows (the ones observed since the change: default all). Older windows are what the change
    was planned on; replaying them would keep a change the load since has shown to be worse."""
    ops = _fitting_order(head, rollback_ops(head, target))
    if ops is None:  # every slot full (a change made by swaps): drops, moves and swaps reach it
        changed = np.flatnonzero((head.phy2log != target.phy2log).any(axis=1)).tolist()
        found = retarget.ops_to(head, target, changed)
        ops = tuple(found) if found is not None else None
    if ops is None:
        return Attempt(None, DecisionOutcome.ROLLBACK_NOT_EXPRESSIBLE, "no order of the operations fits the free slots")
    try:
        table = apply_ops(head, ops)
    except InvalidOperation as e:  # a planner defect must not take the controller down: refused, and said why
        return Attempt(None, DecisionOutcome.ROLLBACK_NOT_EXPRESSIBLE, f"operations do not apply: {e}")
    if not same_ranks(table, target):
        return Attempt(None, DecisionOutcome.ROLLBACK_NOT_EXPRESSIBLE, "operations do not reproduce the parent's placement")
    table.validate()
    check_no_new_rank_duplicates(head, table)
    vg = gain(buf.stats(head, last=last), buf.stats(table, base=head, last=last))
    cm = p.cost_model()
    cost = change_cost(cm, head, table, buf.tokens_per_step())
    if vg < 0:
        return Attempt(None, DecisionOutcome.ROLLBACK_NOT_BETTER, f"replay gain of the rollback {vg:.4f} < 0", (), 0.0, vg, cost)
    lo, hi = buf.span(last)
    return Attempt(Decision(table, ops, vg, vg, cost, trigger, (), "rollback", lo, hi), DecisionOutcome.PROPOSED, "", (), vg, vg, cost)


def repair(head: RoutingTable, lost: list[int], buf: ReplayBuffer, p: DecisionParams) -> Attempt:
    """Drain lost ranks and reload every expert left without a replica from host onto the coolest surviving
    rank (`elastic.plan_repair`). Not gated by tau: it restores a valid table."""
    load = buf.window_totals().sum(axis=0) if buf.steps else None
    try:
        ops = plan_repair(head, set(lost), load)
    except DrainRefused as e:
        return Attempt(None, Reason.NO_FREE_SLOT.value, e.message, (Refused(None, Reason.NO_FREE_SLOT.value, 0.0, 0.0, e.message),))
    if not ops:
        return Attempt(None, DecisionOutcome.NOTHING_TO_REPAIR, f"ranks {lost} are not active")
    table = apply_ops(head, ops)
    table.validate()
    check_no_new_rank_duplicates(head, table)
    vg = gain(buf.stats(head), buf.stats(table)) if buf.steps else 0.0
    cm = p.cost_model()
    cost = change_cost(cm, head, table, buf.tokens_per_step())
    lo, hi = buf.span()
    trig = f"repair: ranks {sorted(lost)} lost"
    return Attempt(Decision(table, tuple(ops), vg, vg, cost, trig, (), "repair", lo, hi), DecisionOutcome.PROPOSED, "", (), vg, vg, cost)
