"""A rank a repair drained is restored by its own node once it is back (agent/decision/rejoin.py): on a fake clock, then
in the simulated 8-node cluster, where a node cut off long enough to be declared dead gets its rank back after
the partition heals (before: drained for good, its GPUs idle until an operator ran `emoe restore`)."""

from __future__ import annotations

from agent.clock import FakeClock
from agent.decision.rejoin import FLAP_S, RETRY_S, Rejoin
from chaos.simcluster import Shape, SimCluster
from elasticmoe.v1 import consensus_pb2 as cpb


def _rejoin(wait_s: float = 3.0, refuse: str = "") -> tuple[FakeClock, Rejoin, list[int]]:
    clock = FakeClock()
    asked: list[int] = []

    def propose(r: int) -> str:
        asked.append(r)
        return refuse

    rj = Rejoin(clock, (2, 3), wait_s, propose)
    rj.active, rj.version = {2, 3}, 1
    return clock, rj, asked


def test_a_repaired_rank_is_restored_after_the_wait_while_its_engine_is_here_and_the_node_able() -> None:
    clock, rj, asked = _rejoin()
    rj.committed(2, 1, [0, 1, 3], "repair")
    clock.advance(2.9)
    rj.due(lambda r: True, able=True)
    assert asked == []  # not yet
    clock.advance(0.2)
    rj.due(lambda r: False, able=True)
    rj.due(lambda r: True, able=False)
    assert asked == []  # its engine is not here, or the node sees no quorum
    rj.due(lambda r: True, able=True)
    assert asked == [2]
    rj.due(lambda r: True, able=True)
    assert asked == [2]  # one proposal per retry interval
    clock.advance(RETRY_S)
    rj.due(lambda r: True, able=True)
    assert asked == [2, 2]  # that one did not commit: tried again
    rj.committed(3, 2, [0, 1, 2, 3], "manual")
    clock.advance(10)
    rj.due(lambda r: True, able=True)
    assert asked == [2, 2] and rj.repaired_at == {}


def test_an_operators_drain_and_a_drain_across_a_gap_are_left_to_the_operator() -> None:
    clock, rj, asked = _rejoin()
    rj.committed(2, 1, [0, 1, 3], "manual")  # `emoe drain 2`
    rj.committed(5, 3, [0, 1], "repair")  # caught up by snapshot: what drained rank 3 is unknown
    clock.advance(100)
    rj.due(lambda r: True, able=True)
    assert asked == []


def test_a_rank_that_flaps_waits_twice_as_long_each_time_and_refusals_are_retried() -> None:
    clock, rj, asked = _rejoin(refuse="PROPOSAL_IN_FLIGHT")
    v = 1
    waits = []
    for _ in range(3):
        rj.committed(v + 1, v, [0, 1, 3], "repair")
        t0 = clock.now()
        while not asked:
            clock.advance(0.1)
            rj.due(lambda r: True, able=True)
        waits.append(round(clock.now() - t0))
        asked.clear()
        rj.committed(v + 2, v + 1, [0, 1, 2, 3], "manual")
        v += 2
        clock.advance(1.0)  # repaired again well within FLAP_S
    assert waits == [3, 6, 12]
    clock.advance(FLAP_S + 1)
    rj.committed(v + 1, v, [0, 1, 3], "repair")
    assert rj.mult[2] == 1  # calm for a minute: back to the plain wait


def test_a_restart_finds_the_repair_in_its_recovered_log() -> None:
    clock = FakeClock()
    asked: list[int] = []
    rj = Rejoin(clock, (2,), 3.0, lambda r: asked.append(r) or "")

    def commit(v: int, active: list[int], kind: int) -> cpb.Commit:
        return cpb.Commit(table=cpb.RoutingTable(version=v, parent=v - 1, active_ranks=active), plan=cpb.Plan(kind=kind))

    head = type("Head", (), {"version": 3, "active_ranks": (0, 1, 3)})()
    rj.recovered([commit(2, [0, 1, 2, 3], cpb.PLAN_REBALANCE), commit(3, [0, 1, 3], cpb.PLAN_REPAIR)], head)
    clock.advance(3.0)
    rj.due(lambda r: True, able=True)
    assert asked == [2]


def test_a_node_cut_off_until_declared_dead_gets_its_rank_back_after_the_partition_heals() -> None:
    c = SimCluster(8, Shape(layers=2, experts=8, ranks_per_node=1, slots_per_rank=2, top_k=2), seed=5)
    c.run(2.0)
    victim = c.ids[3]
    rank = 3
    c.partition([[victim], [n for n in c.ids if n != victim]])
    c.run(6.0)  # declared dead (~2.5 s) and repaired
    heads = {n: c.states[n].head() for n in c.ids if n != victim}
    assert all(rank not in h.active_ranks for h in heads.values()), "the cut-off node's rank was not repaired"
    c.heal()
    c.run(8.0)  # membership heals, the node catches up, then waits rejoin_ms (3 s) and proposes the restore
    assert all(rank in c.states[n].head().active_ranks for n in c.ids), {n: c.states[n].head().active_ranks for n in c.ids}
    restores = [x.plan.trigger for x in c.states[c.ids[0]].commits_since(0) if "restore r3" in x.plan.trigger]
    assert restores and "rank 3 is back after its repair (rejoin)" in restores[-1], restores  # not "operator"
