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
