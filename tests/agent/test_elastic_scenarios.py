"""Issue 10 scenarios in the simulator (chaos.simcluster: full agents, shims and reference engines on a
simulated network, virtual time): rank loss under load, drain below the minimum viable size, drain/restore
cycles under load. Figures are printed (pytest -s) for the issue's note."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.wire import kind_of_trigger
from chaos.invariants import INVARIANTS, check_cluster, check_consensus
from chaos.schedules import load
from chaos.simcluster import Shape, SimCluster
from chaos.simrun import run_schedule
from controlplane.table import initial_table
from controlplane.topology import Topology
from dataplane_shim.counters import DeviceCounters
from dataplane_shim.shim import Shim

logging.getLogger("agent").setLevel(logging.ERROR)


def test_shim_masks_dead_ranks_and_counts_tokens_without_a_live_replica() -> None:
    topo = Topology(4, 1, 4)
    t = initial_table(topo, 2, 8)  # experts 2k, 2k+1 on rank k
    phy = t.phy2log.copy()
    phy[0, 2] = 2  # layer 0: expert 2 also on rank 0 (its other replica is on rank 1)
    t2 = t.successor(phy)
    counters = DeviceCounters(4)
    shims = [Shim(topo, r, t2, counters=counters, wait_polls=0) for r in range(4)]
    s = shims[0]
    ids = torch.arange(8).repeat(3).reshape(-1, 1)  # three tokens of every expert
    plan = s.dispatch(0, ids)
    assert set((plan.slots.reshape(-1).numpy() // 4).tolist()) == {0, 1, 2, 3}
    s.mask_ranks([1])
    plan = s.dispatch(0, ids)
    slots = plan.slots.reshape(-1).numpy()
    sent = ~plan.deferred.reshape(-1)
    assert not (slots[sent] // 4 == 1).any()  # nothing goes to the masked rank
    e = ids.reshape(-1).numpy()
    assert (slots[e == 2] == 2).all() and sent[e == 2].all()  # expert 2 re-routed to its live replica
    assert plan.no_replica is not None
    assert (plan.no_replica.reshape(-1) == (e == 3)).all()  # expert 3 lived only on rank 1: held back
    assert s.stats.no_replica == 3 and 4 <= s.stats.masked <= 6  # expert 3, and expert 2 tokens routed to rank 1
    s.mask_ranks([])
    plan = s.dispatch(0, ids)
    assert not plan.deferred.any() and plan.no_replica is None


def test_forced_operator_plan_is_manual_not_a_rebalance() -> None:
    """A drain is a forced manual plan; read as a rebalance, peers would observe it and could propose to roll
    it back (restoring the drained rank). The kind and the flag are fields of the plan; a plan written
    before they existed is read from its trigger."""
    from agent.wire import make_plan, plan_forced, plan_kind
    from elasticmoe.v1 import consensus_pb2 as cpb

    trig = "manual --force: manual: operator proposal (forced): drain r3"
    p = make_plan((), 0.0, 0.0, 0.0, "step imbalance looks like a rebalance", kind="manual", forced=True)
    assert plan_kind(p) == "manual" and plan_forced(p)  # the fields, whatever the text says
    assert plan_kind(make_plan((), 0, 0, 0, "manual: x", kind="rebalance")) == "rebalance"
    legacy = cpb.Plan(trigger=trig)
    assert plan_kind(legacy) == "manual" and plan_forced(legacy) and kind_of_trigger(trig) == "manual"
    assert not plan_forced(cpb.Plan(trigger=trig, kind=cpb.PLAN_MANUAL))  # typed: the text is only text
    with pytest.raises(ValueError, match="plan kind 'drain'"):
        make_plan((), 0, 0, 0, "", kind="drain")


def _wait_all_detect(c: SimCluster, dead: str, limit_s: float = 10.0) -> float:
    """Run until every survivor's membership holds `dead` dead; returns that time."""
    for _ in range(int(limit_s / 0.05)):
        if all(any(m.node_id == dead and str(m.status.value) == "dead" for m in c.states[n].gossip.members())
               for n in c.up()):
            return c.clock.now()
        c.run(0.05)
    raise AssertionError(f"{dead} not declared dead by every survivor within {limit_s} s")


def test_kill_one_node_of_eight_under_load() -> None:
    c = SimCluster(8, Shape(layers=4, experts=16, ranks_per_node=1, slots_per_rank=4), seed=3)
    c.run(3.0)
    assert len(c.history.commits) >= 2  # rebalances under load before the fault
    victim = "n03"
    t_kill = c.clock.now()
    c.crash(victim, lost=True)
    t_all = _wait_all_detect(c, victim)
    [(_, t_crash, t_first)] = [d for d in c.history.detections if d[0] == victim]
    assert t_crash == t_kill
    to_dead_at_detection = c.tokens.to_dead_undetected
    g = c.ranks_of[victim][0]
    assert all(g in sh.masked for n in c.up() for sh in c.engines[n].shims.values())  # every survivor masks it
    c.run(3.0)  # load goes on after detection
    repairs = [r for r in c.history.commits.values() if r.trigger.startswith("repair") and r.t > t_kill]
    assert repairs, "no repair committed"
    rep = repairs[0]
    # one commit round: the median time from proposal to commit of the rebalances committed before
    inv = {e.op: e.t for e in c.history.events if e.kind == "invoke" and e.t < t_kill}
    lat = [e.t - inv[e.op] for e in c.history.events if e.kind == "respond" and e.result == "ok" and e.op in inv]
    assert lat
    round_s = max(float(np.median(lat)), 1e-3)
    print(f"\nkill {victim} at {t_kill:.2f}: first DEAD verdict after {t_first - t_kill:.3f} s, all survivors "
          f"after {t_all - t_kill:.3f} s; repair v{rep.version} committed {rep.t - t_first:.4f} s after the first "
          f"verdict (commit round {round_s * 1e3:.2f} ms); tokens {c.tokens}; shims {c.shim_totals()}")
    # detection (every survivor knows) + 2 commit rounds, + one takeover: a planner that is not the version's
    # round-0 owner gives the owner accept_timeout first (ConsensusNode.propose), and which node plans the
    # repair depends on the windows since the last commit
    takeover = c.states[c.up()[0]].cfg.consensus.accept_timeout_ms / 1000
    assert rep.t <= t_all + 2 * round_s + takeover
    assert g not in rep.table.active_ranks and rep.table.is_valid()
    assert not (rep.table.phy2log.reshape(4, 8, 4)[:, g] >= 0).any()
    # after detection no token is dispatched to it: none by a sender that knew, none at all after all knew
    assert c.tokens.misrouted == 0
    assert c.tokens.to_dead_undetected == to_dead_at_detection
    assert c.tokens.i4 == 0 and c.tokens.dropped == 0
    viol = check_consensus(c.history)
    assert viol["I1"] == [] and viol["I2"] == [] and viol["I3"] == []
    # I3 throughout: every version any node installed is valid
    assert all(e.valid for e in c.history.events if e.kind == "install")
    c.heal_all()
    assert c.settle(20.0) is not None
    rep_all = check_cluster(c)
    assert rep_all.ok, rep_all.violations


def test_a_drain_while_a_proposal_is_in_flight_waits_for_its_outcome_and_drains() -> None:
    """An operator's drain on a node whose own proposal awaits its outcome was refused at once
    (PROPOSAL_IN_FLIGHT); it waits for that outcome and plans the drain on the head it leaves."""
    from controlplane.ops import Replicate

    c = SimCluster(4, Shape(layers=2, experts=16, ranks_per_node=1, slots_per_rank=8), seed=2)
    c.run(1.0)
    st = c.states["n00"]
    c.partition([["n00"], c.ids[1:]])  # n00's proposal cannot reach a quorum until the heal
    c.clock.call_later(1.0, c.heal)

    async def both() -> tuple[object, object]:
        p = asyncio.ensure_future(st.manual.propose_manual((Replicate(0, 3, 2),), True))
        await asyncio.sleep(0)
        assert st.pipeline.inflight is not None  # the replicate is in flight
        d = asyncio.ensure_future(st.manual.drain(3))
        return await p, await d

    prop, ack = c.admin(both, limit_s=30.0, tries=1)
    assert ack.ok, ack.reason  # type: ignore[attr-defined]
    head = st.head()
    assert 3 not in head.active_ranks and head.version >= 3, head.version
    c.heal_all()
    assert c.settle(20.0) is not None
    rep = check_cluster(c)
    assert rep.ok, rep.violations


def test_drain_below_minimum_viable_size_is_refused_with_the_numbers() -> None:
    # 4 ranks x 4 slots hold 16 experts: no room anywhere for rank 0's lone replicas
    c = SimCluster(4, Shape(layers=2, experts=16, ranks_per_node=1, slots_per_rank=4), seed=1)
    c.run(1.0)
    st = c.states["n00"]
    before = st.head_version()
    ack = asyncio.run(st.manual.drain(0))
    print(f"\nrefused: {ack.reason}")
    assert not ack.ok
    assert "replicas required: 4" in ack.reason and "0 free slots" in ack.reason
    assert "16 experts need at least 4 ranks" in ack.reason
    assert st.head_version() == before


@pytest.mark.parametrize("seed", [5])
def test_twenty_drain_restore_cycles_under_load_misroute_nothing(seed: int) -> None:
    c = SimCluster(8, Shape(layers=4, experts=16, ranks_per_node=1, slots_per_rank=4), seed=seed)
    c.run(2.0)
    drained = restored = 0
    for i in range(20):
        rank = 1 + i % 7
        admin = c.states[c.ids[(i + 3) % 8]]  # any node takes admin calls
        ack = c.admin(lambda a=admin, r=rank: a.manual.drain(r))
        assert ack.ok, ack.reason
        drained += 1
        head = c.states["n00"].head()
        c.run(0.5)
        assert rank not in c.states["n00"].head().active_ranks or c.states["n00"].head().version > head.version
        ack = c.admin(lambda a=admin, r=rank: a.manual.restore(r))
        assert ack.ok, ack.reason
        restored += 1
        c.run(0.5)
    c.heal_all()
    assert c.settle(20.0) is not None
    tk = c.tokens
    print(f"\n{drained} drains, {restored} restores, {len(c.history.commits)} commits; tokens {tk}; "
          f"shims {c.shim_totals()}")
    assert tk.i4 == 0 and tk.misrouted == 0 and tk.dropped == 0 and tk.to_dead_undetected == 0
    assert tk.sent == tk.served + tk.nacked and tk.served > 0
    rep = check_cluster(c)
    assert rep.ok, rep.violations
    assert np.all([e.valid for e in c.history.events if e.kind == "install"])


@pytest.mark.parametrize(("seed", "theta"), [(4, None), (4, 50.0)])
def test_a_restored_rank_gets_experts_at_once_under_load(seed: int, theta: float | None) -> None:
    """Issue 33: `emoe restore` left the rank empty until some later rebalance. Now the restoring node proposes
    experts for it as the restore commits (a rebalance verified by replay and by the voters), and the answer
    names the version that put them there. With theta 50 and no cost-benefit (load_ms 0) no automatic rebalance ever fires, so the fill is
    the restoring node's own; with the default, the window's planner may win the version first (the fill is
    then planned again on its table, if the rank is still empty somewhere)."""
    c = SimCluster(8, Shape(layers=4, experts=16, ranks_per_node=1, slots_per_rank=4), seed=seed,
                   decision=None if theta is None else {"theta": theta, "load_ms": 0.0})
    c.run(2.0)
    admin = c.states["n02"]
    rank = 6
    ack = c.admin(lambda: admin.manual.drain(rank))
    assert ack.ok, ack.reason
    c.run(1.0)
    ack = c.admin(lambda: admin.manual.restore(rank))
    assert ack.ok, ack.reason
    v = int(ack.version)
    print("\n" + ack.reason + "\n" + "\n".join(f"v{r.version}: {r.trigger[:120]}" for r in
                                              sorted(c.history.commits.values(), key=lambda r: r.version)))
    assert ack.reason.startswith(f"restore r{rank} in v") and f"experts on it in v{v}" in ack.reason, ack.reason
    restored_in = int(ack.reason.split(" in v")[1].split(",")[0])
    assert v > restored_in  # the restore left the rank empty; a later version, not a later rebalance, fills it
    if theta is not None:
        filled = c.history.commits[v]
        assert filled.trigger.startswith(f"restore: ranks [{rank}] restored in v{restored_in}") and \
            "planned on the replay windows" in filled.trigger, filled.trigger
    c.run(1.0)
    for n in c.up():
        head = c.states[n].head()
        assert head.version >= v and rank in head.active_ranks
        assert (head.phy2log.reshape(4, 8, 4)[:, rank] >= 0).any(axis=1).all(), n  # work in every layer
    c.heal_all()
    assert c.settle(20.0) is not None
    rep = check_cluster(c)
    assert rep.ok, rep.violations
    assert c.tokens.misrouted == 0 and c.tokens.i4 == 0 and c.tokens.dropped == 0


SCENARIOS = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "elastic").glob("*.txt"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_elastic_scenario_files(path: Path) -> None:
    res = run_schedule(8, 11, load(path), Shape(layers=4, experts=16, slots_per_rank=4))
    print("\n" + "\n".join(res.done) + f"\ntokens {res.tokens}")
    assert res.counts() == dict.fromkeys(INVARIANTS, 0), res.violations
    assert res.tokens["misrouted"] == 0 and res.tokens["i4"] == 0 and res.tokens["dropped"] == 0
    if path.stem == "drain_restore":
        drains = [d for d in res.done if " drain " in d or " restore " in d]
        assert [("refused" in d) for d in drains] == [False, True, False, False, False], drains
    if path.stem == "kill_one_of_eight":
        assert res.repairs >= 1 and res.detect_s
