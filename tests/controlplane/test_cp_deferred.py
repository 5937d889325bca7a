"""A controller that defers its plans (the agent's: controlplane.controller, defer_plans): a window's Ready
asks for a plan, the answer comes back as PlanReady, and is proposed only where nothing moved meanwhile."""

from __future__ import annotations

import numpy as np

from controlplane.controller import (
    Controller,
    ManualProposal,
    PlanReady,
    PlanRequest,
    RanksLost,
    SetPaused,
    TableCommitted,
    WindowReport,
)
from controlplane.decision import same_ranks
from controlplane.ops import Migrate, Replicate, apply_ops
from controlplane.table import RoutingTable
from tests.controlplane.test_cp_controller import feed, setup, windows


def deferred(**kw: object) -> tuple[Controller, RoutingTable]:
    c, head = setup(**kw)
    return Controller(c.params, head, defer_plans=True), head


def asked(c: Controller, ws: list[np.ndarray]) -> PlanRequest:
    """Windows 0 and 1 (the second spends the budget): the plan the controller asks for."""
    for seq in (0, 1):
        r = feed(c, seq, ws[seq])
        c.advance()
    assert len(r.plans) == 1
    return r.plans[0]


def test_a_deferred_plan_is_asked_for_then_proposed_as_the_inline_controller_proposes_it() -> None:
    inline, head = setup()
    later, _ = deferred()
    ws = windows(0, 3)
    for seq in (0, 1):
        a, b = feed(inline, seq, ws[seq]), feed(later, seq, ws[seq])
        inline.advance(), later.advance()
    assert len(a.proposals) == 1 and not a.plans
    assert not b.proposals and len(b.plans) == 1 and later.state == "planning"  # nothing decided inside step
    req = b.plans[0]
    assert req.seq == 1 and req.head is later.head and req.head.content_equal(head) and not req.low
    r = later.step(PlanReady(req, req.run()))
    assert len(r.proposals) == 1 and later.planning is None and later.inflight is r.proposals[0]
    mine, theirs = r.proposals[0], a.proposals[0]
    assert mine.table.content_equal(theirs.table) and mine.ops == theirs.ops and mine.trigger == theirs.trigger
    assert mine.verified_gain == theirs.verified_gain


def test_windows_that_close_while_a_plan_is_computed_are_judged_but_plan_nothing() -> None:
    c, head = deferred()
    ws = windows(0, 5)
    req = asked(c, ws)
    n = len(req.buffer.windows)
    for seq in (2, 3):
        r = feed(c, seq, ws[seq])
        assert not r.plans and not r.proposals and any(isinstance(e, WindowReport) for e in r.events)
        assert c.last_explain().outcome == "PLANNING"  # type: ignore[union-attr]
        c.advance()
    # the request planned on what it saw: the controller's own buffer took the windows since, its snapshot not
    assert len(req.buffer.windows) == n and c.monitor.buffer.windows[-1].seq == 3
    assert [w.seq for w in req.buffer.windows] == [0, 1] and [w.seq for w in c.monitor.buffer.windows] == [1, 2, 3]
    r = c.step(PlanReady(req, req.run()))
    assert len(r.proposals) == 1


def test_a_plan_that_comes_back_after_the_head_moved_is_dropped_and_the_next_window_plans_afresh() -> None:
    c, head = deferred()
    ws = windows(0, 6)
    req = asked(c, ws)
    other = apply_ops(head, (Migrate(0, 1, 0, 7),))  # another node's table for the version
    c.step(TableCommitted(other, "manual"))
    c.advance()
    r = c.step(PlanReady(req, req.run()))
    ex = c.last_explain()
    assert not r.proposals and c.inflight is None and c.planning is None
    assert ex is not None and ex.outcome == "STALE_PLAN" and f"head moved to v{other.version}" in ex.detail
    c.advance()
    r = c.step(PlanReady(req, req.run()))  # an answer nobody waits for (twice): dropped too
    assert not r.proposals and c.last_explain().outcome == "STALE_PLAN"  # type: ignore[union-attr]
    c.advance()
    again = []
    for seq in (2, 3, 4):
        r = feed(c, seq, ws[seq])
        again += r.plans
        c.advance()
    assert again and again[0].head is other  # planned again, on the new head


def test_a_plan_is_dropped_when_a_proposal_or_the_pause_came_meanwhile() -> None:
    for meanwhile in ("pause", "manual"):
        c, _ = deferred()
        req = asked(c, windows(0, 2))
        if meanwhile == "pause":
            c.step(SetPaused(True))
        else:
            assert c.step(ManualProposal((Replicate(0, 1, 7),), force=True)).proposals
        c.advance()
        r = c.step(PlanReady(req, req.run()))
        ex = c.last_explain()
        assert not r.proposals and ex is not None and ex.outcome == "STALE_PLAN", meanwhile
        assert ("paused" if meanwhile == "pause" else "was proposed meanwhile") in ex.detail


def test_a_repair_is_asked_for_then_proposed_as_the_inline_controller_proposes_it_even_while_paused() -> None:
    inline, head = setup()
    later, _ = deferred()
    ws = windows(4, 2)
    for c in (inline, later):
        feed(c, 0, ws[0])
        c.advance()
    later.step(SetPaused(True))  # a repair restores a valid table: the operator's pause does not hold it
    later.advance()
    a, b = inline.step(RanksLost((3,))), later.step(RanksLost((3,)))
    assert len(a.proposals) == 1 and not a.plans
    assert not b.proposals and len(b.plans) == 1 and later.state == "planning"
    req = b.plans[0]
    assert req.kind == "repair" and req.lost == (3,) and req.buffer is not later.monitor.buffer  # a snapshot
    later.advance()
    r = later.step(PlanReady(req, req.run()))
    mine, theirs = r.proposals[0], a.proposals[0]
    assert mine.kind == "repair" and mine.table.content_equal(theirs.table) and mine.ops == theirs.ops
    assert mine.trigger == theirs.trigger and 3 not in mine.table.active_ranks


def test_a_rank_lost_while_a_rebalance_is_computed_is_repaired_first_and_the_rebalance_dropped() -> None:
    c, _ = deferred()
    ws = windows(0, 3)
    rebalance = asked(c, ws)
    r = c.step(RanksLost((3,)))
    assert [q.kind for q in r.plans] == ["repair"]
    repair = r.plans[0]
    c.advance()
    r = c.step(PlanReady(rebalance, rebalance.run()))  # the superseded rebalance comes back first
    assert not r.proposals and c.last_explain().outcome == "STALE_PLAN"  # type: ignore[union-attr]
    assert c.planning is repair
    c.advance()
    r = c.step(PlanReady(repair, repair.run()))
    assert [d.kind for d in r.proposals] == ["repair"]
    # the same where another node is to propose the repair: this one waits a window, and its rebalance is dropped
    c, _ = deferred()
    rebalance = asked(c, ws)
    r = c.step(RanksLost((3,), planner="n1"))
    assert not r.plans and c.last_explain().outcome == "NOT_DESIGNATED"  # type: ignore[union-attr]
    c.advance()
    r = c.step(PlanReady(rebalance, rebalance.run()))
    ex = c.last_explain()
    assert not r.proposals and ex is not None and ex.outcome == "STALE_PLAN" and "[3] were lost" in ex.detail


def test_a_repair_that_comes_back_after_another_rank_was_lost_is_asked_for_again_with_both() -> None:
    c, _ = deferred()
    ws = windows(4, 3)
    feed(c, 0, ws[0])
    c.advance()
    first = c.step(RanksLost((3,))).plans[0]
    c.advance()
    r = c.step(RanksLost((5,)))  # while the first repair is computed
    assert not r.plans and not r.proposals and c.last_explain().outcome == "PLANNING"  # type: ignore[union-attr]
    c.advance()
    r = feed(c, 1, ws[1])  # a window meanwhile: judged, and waits for the repair
    assert not r.plans and not r.proposals and c.last_explain().outcome == "PLANNING"  # type: ignore[union-attr]
    c.advance()
    r = c.step(PlanReady(first, first.run()))
    stale = [e for e in r.events if getattr(e, "outcome", "") == "STALE_PLAN"]
    assert not r.proposals and stale and "lost ranks are [3, 5] now" in stale[0].detail  # type: ignore[attr-defined]
    assert [q.lost for q in r.plans] == [(3, 5)]  # asked for again at once, with both
    again = r.plans[0]
    c.advance()
    r = c.step(PlanReady(again, again.run()))
    d = r.proposals[0]
    assert d.kind == "repair" and not {3, 5} & set(d.table.active_ranks)


def test_a_due_rollback_is_asked_for_and_dropped_when_another_node_rolled_back_meanwhile() -> None:
    c, head = deferred(rollback_windows=2, theta=50.0, load_ms=0.0)  # as test_a_change_that_did_not_help_...
    ws = windows(3, 10)
    bad = apply_ops(head, [Migrate(0, 5, 2, 0), Migrate(1, 5, 2, 0)])
    c.step(TableCommitted(bad, newest_window=-1))
    c.advance()
    for seq in (0, 1):
        feed(c, seq, ws[seq])
        c.advance()
    r = feed(c, 2, ws[2])
    assert not r.proposals and [q.kind for q in r.plans] == ["rollback"]
    req = r.plans[0]
    assert req.target is head and req.last == 2
    c.advance()
    answer = req.run()
    assert answer.decision is not None and same_ranks(answer.decision.table, head)
    rolled = answer.decision.table
    c.step(TableCommitted(rolled))  # another node's rollback, the same placement, commits first
    c.advance()
    r = c.step(PlanReady(req, answer))
    assert not r.proposals and not r.plans and c.last_explain().outcome == "STALE_PLAN"  # type: ignore[union-attr]
    assert c.state == "idle"
