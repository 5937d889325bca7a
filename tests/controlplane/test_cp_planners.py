"""The planner interface (controlplane/planners.py): each planner, chosen by name, proposes through the decision
core, which verifies and gates its plan the same way."""

from __future__ import annotations

import pytest

from controlplane.controller import DecisionParams
from tests.controlplane.test_cp_controller import feed, setup, windows


@pytest.mark.parametrize("planner", ["greedy", "craft"])
def test_each_planner_proposes_through_the_decision_core(planner: str) -> None:
    """The planner is chosen by name (controlplane.planners); whichever proposes, the decision core replays,
    verifies and gates its plan the same way."""
    c, head = setup(planner=planner)
    ws = windows(0, 8)
    feed(c, 0, ws[0])
    c.advance()
    r = feed(c, 1, ws[1])
    assert len(r.proposals) == 1, c.last_explain()
    d = r.proposals[0]
    assert d.kind == "rebalance" and d.ops and d.table.is_valid() and d.verified_gain >= c.params.tau
    if planner == "craft":
        assert "CRAFT" in d.trigger  # its note names it in the explain record
        # CRAFT places replicas on top of one copy of every expert: every expert keeps a slot
        assert all(set(range(16)) <= set(row[row >= 0].tolist()) for row in d.table.phy2log)


def test_an_unknown_planner_is_refused_by_name() -> None:
    from controlplane.decision import InvalidParams

    with pytest.raises(InvalidParams, match="planner='eplb'"):
        DecisionParams(planner="eplb")


def test_a_stuck_greedy_plan_is_polished_by_a_swap_above_polish_theta_only() -> None:
    """Every slot full, no expert held twice: the greedy planner has no move (a replica needs a free slot,
    a drop needs a second copy), so it is stuck 15% above an even split, under fast_theta. Polishing
    (planners.widen at polish_theta) exchanges two experts; below the gap's polish_theta, or off, nothing."""
    import numpy as np

    from controlplane import retarget
    from controlplane.ops import Swap, apply_ops
    from controlplane.planners import PlanInput, PlanKnobs, greedy
    from controlplane.table import initial_table
    from controlplane.topology import Topology

    head = initial_table(Topology(1, 4, 2), 1, 8)  # rank g holds experts 2g and 2g+1
    load = np.array([60, 55, 50, 50, 50, 50, 45, 40], dtype=np.int64)
    assert [sorted(r[r >= 0].tolist()) for r in head.phy2log.reshape(4, 2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    X = load[None, None, :]  # one block, one layer: rank loads 115, 100, 100, 85 against an even 100
    inp = PlanInput(X, 1, np.zeros((1, 8), dtype=bool), None, load[None, :].astype(np.float64))
    cm = DecisionParams().cost_model(4)

    def planned(polish_theta: float) -> tuple[int, list[object], str]:
        pl = greedy(head, inp, cm, PlanKnobs(64, 0.02, 0.01, 1.3, True, polish_theta, 3.0))
        obj = int(retarget.layer_objective(apply_ops(head, pl.ops), X).sum()) if pl.ops else 115
        return obj, list(pl.ops), pl.note

    assert planned(0.0) == (115, [], "")  # off: stuck
    assert planned(1.2) == (115, [], "")  # the gap (1.15) is under polish_theta
    obj, ops, note = planned(1.03)
    assert obj == 100 and ops and all(isinstance(o, Swap) for o in ops), (obj, ops)
    assert note.startswith("greedy stuck (copies x3)"), note


def test_polish_knobs_are_checked_by_name() -> None:
    from controlplane.decision import InvalidParams

    for bad in (dict(polish_theta=0.5), dict(polish_lam=-1.0)):
        with pytest.raises(InvalidParams, match="polish_theta="):
            DecisionParams(**bad)  # type: ignore[arg-type]
