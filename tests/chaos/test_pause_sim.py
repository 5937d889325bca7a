"""The pause switch as cluster state in the in-process simulator (full agents, partitions as faults): a pause
written on one node holds on every node, across a partition that cuts off the node that wrote it and across a
restart of every node; a node cut off from the quorum cannot change it (its error says so); a pause committed
just before such a partition still reaches the majority side. While paused, no rebalance commits, and a repair
of lost ranks still does."""

from __future__ import annotations

import logging

from chaos.simcluster import Shape, SimCluster
from controlplane.decision import DecisionOutcome

logging.getLogger("agent").setLevel(logging.ERROR)


def _switch(c: SimCluster) -> dict[str, tuple[int, str, bool] | None]:
    out: dict[str, tuple[int, str, bool] | None] = {}
    for n in c.up():
        r = c.states[n].view.pause_record()
        out[n] = None if r is None else (int(r.record.seq), r.record.node_id, r.record.paused)
    return out


def _kinds_after(c: SimCluster, version: int) -> set[str]:
    return {rec.kind for v, rec in c.history.commits.items() if v > version}


def test_a_pause_holds_everywhere_across_a_partition_and_a_restart_of_every_node() -> None:
    c = SimCluster(5, Shape(layers=4, experts=16, slots_per_rank=4), seed=11)
    c.run(3.0)
    pauser = c.ids[1]
    ack = c.admin(lambda: c.states[pauser].manual.set_paused(True))
    assert ack.ok and "cluster-wide" in ack.reason, ack
    c.run(1.0)
    assert set(_switch(c).values()) == {(1, pauser, True)}
    assert all(c.states[n].pipeline.paused and c.states[n].view.paused() for n in c.ids)
    head = max(c.heads().values())

    rest = [n for n in c.ids if n != pauser]
    c.partition([[pauser], rest])
    c.run(4.0)
    # the load breached theta meanwhile and the controller said why it planned nothing (beyond SetPaused's own note)
    assert all(c.states[n].pipeline.outcomes[DecisionOutcome.PAUSED] > 1 for n in rest)
    nack = c.admin(lambda: c.states[pauser].manual.set_paused(False), limit_s=30.0)
    assert not nack.ok and "not committed" in nack.reason and "did not change" in nack.reason, nack
    assert all(c.states[n].pipeline.paused for n in rest)
    c.heal()
    c.run(6.0)  # the resume its writer gave up never takes effect, on either side
    assert set(_switch(c).values()) == {(1, pauser, True)}

    for n in list(c.ids):  # kill -9 every node, then start them all again
        c.crash(n)
    for n in list(c.ids):
        c.restart(n)
    assert all(c.states[n].pipeline.paused for n in c.ids)  # recovered from each store, before any message
    c.run(6.0)
    assert set(_switch(c).values()) == {(1, pauser, True)}
    assert "rebalance" not in _kinds_after(c, head), c.history.commits  # windows closed, none rebalanced
    planners = {c.states[n].view.planner() for n in c.ids}
    assert len(planners) == 1 and planners <= set(c.ids)  # every node names the same planner

    ack = c.admin(lambda: c.states[c.ids[3]].manual.set_paused(False))
    assert ack.ok, ack
    c.run(1.0)
    assert set(_switch(c).values()) == {(2, c.ids[3], False)}
    assert not any(c.states[n].pipeline.paused for n in c.ids)


def test_a_pause_committed_just_before_its_writer_is_cut_off_reaches_the_majority() -> None:
    c = SimCluster(5, Shape(layers=4, experts=16, slots_per_rank=4), seed=5)
    c.run(3.0)
    pauser = c.ids[0]
    rest = [n for n in c.ids if n != pauser]
    # the moment the writer knows its record certified it is cut off: its learns are lost on the wire
    c.states[pauser].pause.on_change(lambda cm: c.partition([[pauser], rest]) if not c.partitioned else None)
    ack = c.admin(lambda: c.states[pauser].manual.set_paused(True))
    assert ack.ok, ack
    c.run(8.0)  # the voters that accepted it complete it on their side
    assert {_switch(c)[n] for n in rest} == {(1, pauser, True)}
    assert all(c.states[n].pipeline.paused for n in rest)


def test_while_paused_a_lost_node_is_still_repaired() -> None:
    c = SimCluster(4, Shape(layers=4, experts=16, slots_per_rank=8), seed=2)  # room for a lost rank's experts
    c.run(3.0)
    ack = c.admin(lambda: c.states[c.ids[0]].manual.set_paused(True))
    assert ack.ok, ack
    head = max(c.heads().values())
    c.crash(c.ids[3], lost=True)  # its ranks drop tokens until they are repaired
    c.run(10.0)
    kinds = _kinds_after(c, head)
    assert "repair" in kinds and "rebalance" not in kinds, c.history.commits
