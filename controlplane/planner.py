"""Incremental planner: replicate / migrate / consolidate operations sized to the breach, never a reshuffle.

Works on the replay buffer's block totals X [nb, L, E] (tokens per block of a few steps). A layer's
objective is the sum over blocks of its max rank load; the estimated gain of a plan is how much it lowers
the sum over layers (exact on X, integer), relative to it. `controlplane.greedy` proposes, per layer and in
rounds vectorised over layers, moves off the hottest rank (replicate, migrate, or drop a cold second replica
on a full destination and move into its slot; nearest target first among equals). This module sizes the
plan: moves are taken in the order they were found, within `max_ops` and the cost budget (a layer whose
next move does not fit stops there); then each layer keeps the prefix of its moves that maximises its gain
minus `min_op_gain` per move, so a plan holds as many operations as the breach justifies and no move that
does not pay for itself. Every candidate not chosen is returned with a stable reason code (the first
round's runners-up, the last candidates of every layer that stopped, and every move cut). Deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from controlplane import greedy
from controlplane.cost import CostModel
from controlplane.ops import Consolidate, Migrate, Operation, Replicate, describe
from controlplane.profile import StabilityProfile
from controlplane.table import RoutingTable

I64 = npt.NDArray[np.int64]


class Reason(StrEnum):
    NO_GAIN = "NO_GAIN"  # does not lower its layer's max rank load
    GAIN_BELOW_TAU = "GAIN_BELOW_TAU"  # a move that gains less than min_op_gain, or a plan below tau
    NO_FREE_SLOT = "NO_FREE_SLOT"  # no active rank can take it, even after consolidating a cold replica
    OVER_BUDGET = "OVER_BUDGET"  # would exceed the decision's cost budget
    OVER_REPLICA_BUDGET = "OVER_REPLICA_BUDGET"  # would exceed the replica-memory budget
    MAX_OPS = "MAX_OPS"  # the plan is full
    SUPERSEDED = "SUPERSEDED"  # another move of its layer scored better in that round
    COOLDOWN = "COOLDOWN"  # the expert was part of a rolled-back change
    VERIFY_NO_GAIN = "VERIFY_NO_GAIN"  # its layer did not gain when replayed step by step
    NOT_WORTH = "NOT_WORTH"  # the plan's gain over the horizon does not repay its copies (controlplane.worth)
    # its replayed gain reaches tau on average, but not beyond the spread of the replay's rows: its lower
    # confidence bound (verify.gain_bound, DecisionParams.gain_confidence) is not above 0
    GAIN_NOT_SIGNIFICANT = "GAIN_NOT_SIGNIFICANT"


REASONS = tuple(Reason)
# greedy status codes -> reasons
_STATUS = {greedy.NO_GAIN: Reason.NO_GAIN.value, greedy.COOLDOWN: Reason.COOLDOWN.value,
           greedy.NO_FREE_SLOT: Reason.NO_FREE_SLOT.value, greedy.OVER_REPLICA_BUDGET: Reason.OVER_REPLICA_BUDGET.value}


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
    note: str = ""  # why the plan has the shape it has, when that is not the greedy default (explain shows it)
    table: RoutingTable | None = None  # the head with `ops` applied, where the planner built it already




def _main_op(lay: int, kind: int, e: int, src: int, dst: int) -> Operation:
    return Replicate(lay, e, dst) if kind == greedy.REPLICATE else Migrate(lay, e, src, dst)


def _detail(lay: int, v: int, keep: int) -> str:
    return f"after consolidate L{lay} E[{v}] -> r{keep}" if v >= 0 else ""


def plan(table: RoutingTable, X: npt.NDArray[np.integer], steps: int, cost: CostModel, max_ops: int, tau: float,
         profile: StabilityProfile | None = None, cooldown: npt.NDArray[np.bool_] | None = None,
         min_op_gain: float | None = None) -> Plan:
    """Plan up to `max_ops` moves (a Consolidate that makes room is not counted) from `table`. X: block
    totals [nb, L, E] of the replay buffer (`steps` steps in all); cooldown [L, E]: experts to leave alone.
    Each layer keeps only moves that pay `min_op_gain` of its own layer's objective each (default tau /
    max_ops): a per-layer fraction, so that a move's worth does not shrink as the model gets more layers."""
    X64: I64 = np.asarray(X, dtype=np.int64)
    L, E = table.layers, table.experts
    cls = profile.classes if profile is not None else np.zeros((L, E), dtype=np.int8)
    cool = cooldown if cooldown is not None else np.zeros((L, E), dtype=bool)
    if max_ops < 1 or X64.shape[0] == 0:
        return Plan((), (), 0.0, 0.0, ())
    st, mv, rf = greedy.search(table, X64, steps, cost, cls, cool, max_ops)
    base = int(st.obj0.sum())
    if base == 0:
        return Plan((), (), 0.0, 0.0, ())
    lam = (tau / max_ops if min_op_gain is None else min_op_gain) * st.obj0.astype(np.float64)  # [L]
    K = int(mv.layer.size)
    # 1. in the order found: within max_ops and the budget; a layer whose move does not fit stops there
    cut = np.zeros(K, dtype=np.int64)  # 0 kept, else why not
    stopped: set[int] = set()
    spent, n = 0.0, 0
    for i, (lay, c) in enumerate(zip(mv.layer.tolist(), mv.cost.tolist(), strict=True)):
        if lay in stopped:
            cut[i] = cut[i - 1] if cut[i - 1] else 1
            continue
        if n >= max_ops or spent + c > cost.budget_s:
            cut[i] = 1 if n >= max_ops else 2
            stopped.add(lay)
            continue
        spent += c
        n += 1
    # 2. per layer, the prefix of kept moves that maximises gain - lam x moves (ties: fewer moves)
    kept = cut == 0
    order = np.lexsort((np.arange(K), mv.layer))
    lay_s = mv.layer[order]
    pos = np.arange(K) - np.searchsorted(lay_s, lay_s)  # index within the layer
    val = np.where(kept[order], (st.obj0[lay_s] - mv.obj[order]) - lam[lay_s] * (pos + 1), -np.inf)
    best_n = np.zeros(L, dtype=np.int64)
    best_v = np.zeros(L, dtype=np.float64)
    for k in range(K):  # ascending position within each layer: strict > keeps the shortest best prefix
        lay = int(lay_s[k])
        if val[k] > best_v[lay] + 1e-9:
            best_v[lay], best_n[lay] = float(val[k]), int(pos[k]) + 1
    take = np.zeros(K, dtype=bool)
    take[order] = pos < best_n[lay_s]
    ops: list[Operation] = []
    op_layers: list[int] = []
    chosen_keys: set[tuple[int, ...]] = set()
    refused: list[Refused] = []
    final = st.obj0.copy()
    cols = zip(mv.layer.tolist(), mv.kind.tolist(), mv.expert.tolist(), mv.src.tolist(), mv.dst.tolist(),
               mv.victim.tolist(), mv.keep.tolist(), mv.obj.tolist(), mv.cost.tolist(), take.tolist(), cut.tolist(),
               strict=True)
    prev = st.obj0.copy()
    for lay, kd, e, s_, d, v, kp, ob, c, tk, ct in cols:
        main = _main_op(lay, kd, e, s_, d)
        g = float(prev[lay] - ob) / base
        prev[lay] = ob
        if tk:
            if v >= 0:
                ops.append(Consolidate(lay, (v,), kp))
                op_layers.append(lay)
            ops.append(main)
            op_layers.append(lay)
            final[lay] = ob
            chosen_keys.add((lay, kd, e, -1 if kd == greedy.REPLICATE else s_, d))
        else:
            why = (Reason.GAIN_BELOW_TAU if not ct else Reason.MAX_OPS if ct == 1 else Reason.OVER_BUDGET).value
            refused.append(Refused(main, why, g, c, _detail(lay, v, kp)))
    for lay, kd, e, s_, d, v, kp, stt, gn, sup in zip(
            rf.layer.tolist(), rf.kind.tolist(), rf.expert.tolist(), rf.src.tolist(), rf.dst.tolist(),
            rf.victim.tolist(), rf.keep.tolist(), rf.status.tolist(), rf.gain.tolist(), rf.superseded.tolist(),
            strict=True):
        if (lay, kd, e, -1 if kd == greedy.REPLICATE else s_, d) in chosen_keys:
            continue
        why = Reason.SUPERSEDED.value if sup and stt == greedy.OK else _STATUS.get(stt, Reason.NO_GAIN.value)
        refused.append(Refused(_main_op(lay, kd, e, s_, d), why, gn / base, 0.0, _detail(lay, v, kp)))
    changed = sorted(set(op_layers))
    lg = tuple((lay, float(st.obj0[lay] - final[lay]) / base) for lay in changed)
    total_cost = float(mv.cost[take].sum()) if K else 0.0
    return Plan(tuple(ops), tuple(op_layers), float(st.obj0.sum() - final.sum()) / base, total_cost,
                tuple(refused), lg)
