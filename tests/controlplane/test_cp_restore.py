"""A restored rank gets work at once (issue 33): the controller whose restore commits proposes experts for the
rank (controlplane.restore.fill), planned on the replay windows and verified by replay, or by slot count
before any load."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.controller import (
    Controller,
    DecisionParams,
    ManualProposal,
    PlanReady,
    RanksLost,
    TableCommitted,
    WindowClosed,
)
from controlplane.elastic import plan_drain, plan_restore
from controlplane.monitor import ReplayBuffer
from controlplane.ops import Migrate, apply_ops
from controlplane.restore import fill, plan_fill
from controlplane.table import RoutingTable, check_no_new_rank_duplicates, initial_table
from controlplane.topology import Topology
from controlplane.verify import gain

W = 20
TOPO = Topology(3, 4, 6)  # the local configs' shape: 12 ranks x 6 slots
L, E = 4, 64


def drained_then_restored(rank: int = 5) -> tuple[RoutingTable, RoutingTable]:
    t = initial_table(TOPO, L, E)
    drained = apply_ops(t, plan_drain(t, rank))
    return drained, apply_ops(drained, plan_restore(drained, rank))


def on_rank(t: RoutingTable, rank: int) -> np.ndarray:
    """[L] experts rank `rank` holds in each layer."""
    return (t.phy2log.reshape(t.layers, TOPO.ranks, TOPO.slots_per_rank)[:, rank] >= 0).sum(axis=1)


def skewed(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = np.ones((L, E))
    p[:, :8] = 6.0  # experts 0-7 (ranks 0-1) are hot
    p /= p.sum(axis=1, keepdims=True)
    return [np.stack([rng.multinomial(4000, p[i], size=W) for i in range(L)], axis=1).astype(np.uint32)
            for _ in range(n)]


def test_plan_fill_gives_the_rank_its_share_by_slot_count() -> None:
    _, back = drained_then_restored()
    assert on_rank(back, 5).tolist() == [0] * L
    ops = plan_fill(back, [5])
    assert all(isinstance(o, Migrate) and o.dst == 5 for o in ops)
    t = apply_ops(back, ops)
    t.validate()
    check_no_new_rank_duplicates(back, t)
    assert on_rank(t, 5).tolist() == [E // TOPO.ranks] * L  # 64 experts over 12 ranks: 5 each
    occupied = (t.phy2log.reshape(L, TOPO.ranks, -1) >= 0).sum(axis=2)
    assert (occupied.max(axis=1) - occupied.min(axis=1) <= 1).all()  # as even as the slots allow
    assert plan_fill(t, [5]) == ()  # nothing more once the rank holds experts
    assert plan_fill(back, [5]) == ops  # deterministic


def test_plan_fill_takes_load_off_the_hottest_donor() -> None:
    _, back = drained_then_restored()
    load = np.ones((L, E), dtype=np.int64)
    load[:, 6:12] = 100  # rank 1's experts (6 slots each) are hot
    ops = plan_fill(back, [5], load)
    assert {o.src for o in ops if isinstance(o, Migrate)} and all(
        isinstance(o, Migrate) and o.dst == 5 for o in ops)
    before = gain_of(back, apply_ops(back, ops), load)
    assert before >= 0.0


def gain_of(a: RoutingTable, b: RoutingTable, load: np.ndarray) -> float:
    buf = ReplayBuffer(L, E, 4)
    buf.push(0, 0, load[None].astype(np.uint32))
    return gain(buf.stats(a), buf.stats(b, base=a))


def test_fill_without_load_is_by_slot_count() -> None:
    _, back = drained_then_restored()
    p = DecisionParams(window=W)
    a = fill(back, [5], ReplayBuffer(L, E, 3), p, np.zeros((L, E), bool), "restore: ranks [5] restored in v3")
    assert a.decision is not None and a.decision.kind == "manual"  # the restore's second half: not observed
    assert on_rank(a.decision.table, 5).tolist() == [5] * L
    assert "20 experts onto ranks [5] (by slot count: no load window yet)" in a.decision.trigger


def test_fill_under_load_is_planned_and_verified_by_replay() -> None:
    _, back = drained_then_restored()
    p = DecisionParams(window=W, expert_bytes=1 << 20)
    buf = ReplayBuffer(L, E, 3)
    for seq, w in enumerate(skewed(1, 3)):
        buf.push(seq, seq * W, w)
    a = fill(back, [5], buf, p, np.zeros((L, E), bool), "restore: ranks [5] restored in v3")
    assert a.decision is not None
    d = a.decision
    assert on_rank(d.table, 5).min() > 0, on_rank(d.table, 5)  # every layer has work on the rank
    assert d.verified_gain > 0 and gain(buf.stats(back), buf.stats(d.table, base=back)) == pytest.approx(
        d.verified_gain)
    assert "planned on the replay windows" in d.trigger and d.replay_to_step == 3 * W


def test_the_controller_proposes_experts_when_its_restore_commits() -> None:
    drained, _ = drained_then_restored()
    c = Controller(DecisionParams(window=W, expert_bytes=1 << 20), drained)
    for seq, w in enumerate(skewed(2, 2)):
        c.step(WindowClosed(seq, seq * W, w, planner="n2"))  # another node plans: no rebalance of our own
        c.advance()
    ready = c.step(ManualProposal(plan_restore(drained, 5), force=True))
    [restore] = ready.proposals
    c.advance()
    ready = c.step(TableCommitted(restore.table, "manual"))
    [filled] = ready.proposals  # at once, not at some later window
    assert filled.kind == "manual" and filled.table.parent == restore.table.version
    assert on_rank(filled.table, 5).min() > 0
    assert c.last_fill is not None and c.last_fill[0] == restore.table.version
    assert c.last_fill[1].decision is filled
    c.advance()
    # a restore another node committed is not ours to fill (its own controller does)
    c2 = Controller(DecisionParams(window=W), drained)
    assert c2.step(TableCommitted(restore.table, "manual")).proposals == [] and c2.last_fill is None


def restored_under(c: Controller, drained: RoutingTable) -> RoutingTable:
    """Two windows (another node plans them), then this controller's restore of rank 5 commits: its table."""
    for seq, w in enumerate(skewed(2, 2)):
        c.step(WindowClosed(seq, seq * W, w, planner="n2"))
        c.advance()
    [restore] = c.step(ManualProposal(plan_restore(drained, 5), force=True)).proposals
    c.advance()
    return restore.table


def test_a_deferred_fill_is_asked_for_as_the_restore_commits_and_proposed_as_the_inline_one() -> None:
    drained, _ = drained_then_restored()
    p = DecisionParams(window=W, expert_bytes=1 << 20)
    inline, later = Controller(p, drained), Controller(p, drained, defer_plans=True)
    restore = restored_under(inline, drained)
    assert restored_under(later, drained).content_equal(restore)
    [theirs] = inline.step(TableCommitted(restore, "manual")).proposals
    ready = later.step(TableCommitted(restore, "manual"))
    assert not ready.proposals and [(q.kind, q.ranks, q.restore_version) for q in ready.plans] == [
        ("fill", (5,), restore.version)]
    assert later.last_fill is None  # not decided yet: `emoe restore` waits for it
    req = ready.plans[0]
    later.advance()
    [mine] = later.step(PlanReady(req, req.run())).proposals
    assert mine.table.content_equal(theirs.table) and mine.ops == theirs.ops and mine.trigger == theirs.trigger
    assert later.last_fill is not None and later.last_fill == (restore.version, later.last_fill[1])
    assert later.last_fill[1].decision is mine


def test_a_fill_that_comes_back_stale_is_asked_for_again_on_the_new_head_or_gives_way_to_a_repair() -> None:
    drained, _ = drained_then_restored()
    c = Controller(DecisionParams(window=W, expert_bytes=1 << 20), drained, defer_plans=True)
    restore = restored_under(c, drained)
    [first] = c.step(TableCommitted(restore, "manual")).plans
    c.advance()
    other = apply_ops(restore, (Migrate(0, 1, 0, 5),))  # another node's table commits meanwhile
    assert (on_rank(other, 5) == 0).any()  # rank 5 still empty in some layers: a fill is still wanted
    c.step(TableCommitted(other, "manual"))
    c.advance()
    ready = c.step(PlanReady(first, first.run()))
    assert not ready.proposals and c.last_explain().outcome == "STALE_PLAN"  # type: ignore[union-attr]
    [again] = ready.plans
    assert again.kind == "fill" and again.head is other and again.restore_version == restore.version
    c.advance()
    c.step(RanksLost((9,)))  # a rank is lost while the fill is computed: its repair comes first
    c.advance()
    ready = c.step(PlanReady(again, again.run()))
    assert not ready.proposals and [q.kind for q in ready.plans] == ["repair"]
    assert c.last_fill is not None and c.last_fill[1].decision is None and c.last_fill[1].outcome == "STALE_PLAN"
