"""Restarts: a restarted agent plans from its recovered head, so a whole-cluster restart (a rolling upgrade of
an idle cluster) can commit again at once, and so can a single restarted node's own proposals."""

from __future__ import annotations

import logging

from chaos.simcluster import Shape, SimCluster

logging.getLogger("agent").setLevel(logging.ERROR)


def _drain_restore(c: SimCluster, via: str, rank: int) -> tuple[bool, str]:
    st = c.states[via]
    ack = c.admin(lambda: st.manual.drain(rank))
    if not ack.ok:
        return False, f"drain {rank} via {via}: {ack.reason}"
    ack = c.admin(lambda: st.manual.restore(rank))
    return bool(ack.ok), f"restore {rank} via {via}: {ack.reason}"


def test_whole_cluster_restart_then_commit() -> None:
    c = SimCluster(3, Shape(ranks_per_node=2, slots_per_rank=4), seed=3)
    c.run(2.0)
    ok, why = _drain_restore(c, "n00", 1)
    assert ok, why
    before = max(c.heads().values())
    assert before >= 3
    for n in list(c.ids):
        c.crash(n)
    for n in list(c.ids):
        c.restart(n)
    assert all(v == before for v in c.heads().values())  # recovered from disk (I7)
    # no load window needs to close first: the operator's commands commit straight away
    ok, why = _drain_restore(c, "n01", 2)
    assert ok, why
    assert c.settle(10.0) is not None
    assert min(c.heads().values()) >= before + 2


def test_one_restarted_node_proposes_at_once() -> None:
    c = SimCluster(3, Shape(ranks_per_node=2, slots_per_rank=4), seed=4)
    c.run(2.0)
    ok, why = _drain_restore(c, "n02", 0)
    assert ok, why
    c.crash("n02")
    c.restart("n02")
    ok, why = _drain_restore(c, "n02", 1)
    assert ok, why


def test_a_forged_member_claiming_a_live_nodes_rank_cannot_get_it_drained() -> None:
    """A member that claims another node's rank and then 'dies' (forged in plaintext, or misconfigured)
    drains nothing: that rank is held by a live member."""
    from elasticmoe.v1 import gossip_pb2 as gpb

    c = SimCluster(3, Shape(ranks_per_node=2, slots_per_rank=4), seed=5)
    c.run(2.0)
    victim = c.ranks_of["n01"][0]
    for n in c.up():
        c.states[n].gossip.absorb("n02", [gpb.MemberState(node_id="mallory", address="10.9.9.9:7400",
                                                          status=gpb.ALIVE, incarnation=1, ranks=[victim])], [])
    c.run(0.5)
    for n in c.up():
        c.states[n].gossip.absorb("n02", [gpb.MemberState(node_id="mallory", address="10.9.9.9:7400",
                                                          status=gpb.DEAD, incarnation=2, ranks=[victim])], [])
    c.run(3.0)
    for n in c.up():
        assert victim in c.states[n].head().active_ranks, f"{n} drained rank {victim} of a live node"


def test_the_node_consumes_the_whole_ready_in_order() -> None:
    """NodeState takes every part of the controller's Ready: every proposal it made reaches the decision
    journal, and its resolution after it."""
    from controlplane.controller import ProposalRecord, Resolution

    c = SimCluster(3, Shape(ranks_per_node=2, slots_per_rank=4), seed=6)
    c.run(2.0)
    st = c.states["n01"]
    ok, why = _drain_restore(c, "n01", 0)
    assert ok, why
    recs = list(st.pipeline.journal)
    proposed = [r.version for r in recs if isinstance(r, ProposalRecord)]
    resolved = {r.version: r.outcome for r in recs if isinstance(r, Resolution)}
    assert len(proposed) >= 2 and set(proposed) <= set(resolved), recs  # every proposal ended, recorded
    assert "COMMITTED" in resolved.values()
    for i, r in enumerate(recs):  # each resolution comes after its proposal's record
        if isinstance(r, Resolution):
            assert any(isinstance(q, ProposalRecord) and q.version == r.version for q in recs[:i]), recs


def test_lifecycle_moves_are_counted() -> None:
    from agent.admin.telemetry import Telemetry

    tel = Telemetry.for_tests()
    tel.record_transition("manual", "PROPOSED")
    tel.record_transition("manual", "COMMITTED")
    points = tel.metrics()["emoe.decision.transitions"]
    assert {(p.attributes["kind"], p.attributes["state"]) for p in points} == {("manual", "PROPOSED"),
                                                                              ("manual", "COMMITTED")}
