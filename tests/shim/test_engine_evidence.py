"""Lifeguard's local evidence from the engine: a rank that cannot reach a peer makes its agent suspect the
peer's node at once; a live node refutes; a crashed one is declared dead sooner than by probes alone."""

from __future__ import annotations

import numpy as np
import pytest

from agent.gossip.membership import MemberStatus
from agent.transport.sim import LinkSpec
from chaos.gossipsim import GossipSim, profile_gossip
from dataplane_shim.errors import BadInput
from dataplane_shim.link import MAX_UNREACHABLE, check_load_report, make_load_report


def _sim(n: int = 8, seed: int = 3) -> GossipSim:
    sim = GossipSim(seed=seed, cfg=profile_gossip("lan"), link=LinkSpec())
    sim.add_nodes(n)
    assert sim.stabilize(limit=60.0) is not None
    sim.run(1.0)
    return sim


def _dead_at(sim: GossipSim, victim: str, t0: float) -> float:
    """Seconds from t0 until the last other node marked `victim` DEAD (inf if one never did)."""
    first: dict[str, float] = {}
    for e in sim.events:
        if e.member.node_id == victim and e.member.status == MemberStatus.DEAD and e.t >= t0:
            first.setdefault(e.observer, e.t)
    return max(first.get(o, float("inf")) for o in sim.ids() if o != victim) - t0


def test_engine_evidence_suspects_at_once_and_declares_a_crash_dead_sooner() -> None:
    times = {}
    for evidence in (False, True):
        sim = _sim()
        victim = sim.ids()[-1]
        sim.events.clear()
        t0 = sim.clock.now()
        sim.crash(victim)
        if evidence:
            sim.run(0.05)  # the engines' collective timeout
            for n in sim.ids():
                if n != victim:
                    assert sim.nodes[n].suspect_members([victim]) == [victim]
                    assert sim.nodes[n].member(victim).status == MemberStatus.SUSPECT  # at once, not after probes
        sim.run(8.0)
        times[evidence] = _dead_at(sim, victim, t0)
    assert times[True] < times[False] < float("inf")
    print(f"\ncrash to dead everywhere: probes only {times[False]:.2f} s, with engine evidence {times[True]:.2f} s")


def test_a_live_node_accused_by_an_engine_refutes_and_stays_alive() -> None:
    sim = _sim()
    accused, accuser = sim.ids()[2], sim.ids()[0]
    inc = sim.nodes[accused].incarnation
    sim.events.clear()
    assert sim.nodes[accuser].suspect_members([accused, accuser]) == [accused]  # never itself
    sim.run(8.0)
    assert not any(e.member.node_id == accused and e.member.status == MemberStatus.DEAD for e in sim.events)
    assert sim.nodes[accused].incarnation > inc  # it heard the suspicion and refuted it
    assert all(sim.nodes[n].member(accused).status == MemberStatus.ALIVE for n in sim.ids())


def test_suspect_ranks_maps_ranks_to_the_members_holding_them() -> None:
    sim = _sim(4)
    me = sim.nodes[sim.ids()[0]]
    other = [m for m in me.members() if m.node_id != me.node_id and m.ranks][0]
    assert me.suspect_ranks([other.ranks[0]]) == [other.node_id]
    assert me.suspect_ranks([10**6]) == []  # a rank nobody holds accuses nobody


def test_load_reports_bound_and_check_the_unreachable_ranks() -> None:
    counts = np.zeros((2, 4), dtype=np.uint32)
    r = make_load_report("s", 1, 0, 1, 1, counts, unreachable_ranks=[3, 2, 3])
    assert list(r.unreachable_ranks) == [2, 3] and check_load_report(r) == ""
    with pytest.raises(BadInput, match="this report's rank 1"):
        make_load_report("s", 1, 0, 1, 1, counts, unreachable_ranks=[1])
    with pytest.raises(BadInput, match="unreachable_ranks"):
        make_load_report("s", 1, 0, 1, 1, counts, unreachable_ranks=[-2])
    r = make_load_report("s", 1, 0, 1, 1, counts)
    r.unreachable_ranks.extend(range(2, MAX_UNREACHABLE + 3))
    assert "at most" in check_load_report(r)


def test_the_agent_suspects_the_nodes_its_engine_cannot_reach() -> None:
    """The agent's load path (agent.link.loadpath.LoadPath, the shim link's sink) hands a report's unreachable ranks
    to gossip, and refuses ranks outside the cluster (naming the field) before anything is counted."""
    from agent.link.loadpath import LoadPath, LoadReportError
    from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
    from controlplane.topology import Topology

    accused: list[list[int]] = []
    ran: list[tuple[int, int]] = []

    class Gossip:
        def suspect_ranks(self, ranks: object) -> list[str]:
            accused.append(list(ranks))  # type: ignore[call-overload]
            return ["n2"]

        def publish_window(self, *a: object) -> None: ...

        def live_nodes(self) -> list[str]:
            return ["n1", "n2"]

    told: list[tuple[int, ...]] = []  # the evidence handed on: agent.decision.reactions judges whether they are lost
    load = LoadPath("n1", Topology(2, 2, 4), 2, 4, 100, Gossip(), lambda seq, total: None,
                    lambda rank, version: ran.append((rank, version)), lambda: "",
                    ReportGuard([0, 1], 4, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: 1), unreachable=told.append)
    counts = np.zeros((2, 4), dtype=np.uint32)
    with pytest.raises(LoadReportError, match="unreachable_ranks"):
        load.on_report(make_load_report("s", 0, 0, 1, 1, counts, unreachable_ranks=[4]))
    with pytest.raises(LoadReportError, match=r"shape \[3, 4\]"):
        load.on_report(make_load_report("s", 0, 0, 1, 1, np.zeros((3, 4), dtype=np.uint32)))
    assert accused == [] and ran == []
    load.on_report(make_load_report("s", 0, 0, 1, 1, counts, unreachable_ranks=[2, 3]))
    assert accused == [[2, 3]]
    load.on_report(make_load_report("s", 0, 0, 0, 1, counts, unreachable_ranks=[3]))  # evidence only
    assert accused == [[2, 3], [3]] and ran == [(0, 1), (0, 1)] and told == [(2, 3), (3,)]


def test_a_cluster_window_names_the_nodes_whose_active_ranks_it_lacks() -> None:
    """LoadPath's `absent` (agent.decision.reactions.MembershipReactions.absent): a window summed over every live node
    still lacks a dead node's ranks while they are active; it names that node among its missing ones, after
    the live ones that lag."""
    from agent.link.loadpath import LoadPath
    from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
    from controlplane.topology import Topology

    closed: list[tuple[int, tuple[str, ...]]] = []
    asked: list[list[str]] = []

    class Gossip:
        def suspect_ranks(self, ranks: object) -> list[str]:
            return []

        def publish_window(self, *a: object, **k: object) -> None: ...

        def live_nodes(self) -> list[str]:
            return ["n1", "n2"]  # n3 is dead

    def absent(nodes: list[str]) -> tuple[str, ...]:
        asked.append(list(nodes))
        return ("n3",) if "n2" in nodes else ("n2", "n3")

    load = LoadPath("n1", Topology(3, 1, 4), 2, 4, 10, Gossip(), lambda seq, total, rows, missing:
                    closed.append((seq, missing)), lambda rank, version: None, lambda: "",
                    ReportGuard([0], 3, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: 1), absent=absent)
    counts = np.ones((2, 4), np.uint32)
    load.on_window("n1", 0, counts)
    load.on_window("n2", 0, counts)
    assert closed == [(0, ("n3",))] and asked == [["n1", "n2"]]
    for seq in (1, 2, 3):  # n2 lags: window 1 closes without it, lag windows later
        load.on_window("n1", seq, counts)
    assert closed[1] == (1, ("n2", "n3"))


def test_an_evidence_report_has_no_steps_and_no_load() -> None:
    counts = np.zeros((2, 4), dtype=np.uint32)
    assert check_load_report(make_load_report("s", 1, 7, 0, 1, counts, unreachable_ranks=[2])) == ""
    with pytest.raises(BadInput, match="steps = 0"):
        make_load_report("s", 1, 7, 0, 1, counts)  # no evidence: a report of nothing
    with pytest.raises(BadInput, match="steps = 0"):
        make_load_report("s", 1, 7, 0, 1, counts + 1, unreachable_ranks=[2])  # load over no steps


class _Store:
    """torch.distributed.Store's add(): an atomic counter per key (add(key, 0) reads it)."""

    def __init__(self) -> None:
        self.kv: dict[str, int] = {}
        self.down = False

    def add(self, key: str, n: int) -> int:
        if self.down:
            raise RuntimeError("Connection reset by peer")
        self.kv[key] = self.kv.get(key, 0) + n
        return self.kv[key]


def test_peer_watch_names_the_ranks_that_stopped_beating() -> None:
    from dataplane_shim.peers import PeerWatch

    store = _Store()
    w = [PeerWatch(store, r, 3, period_s=0.02, prefix="t") for r in range(3)]
    try:
        w[2].close()  # rank 2's process is gone: its counter stops
        assert w[0].unreachable(wait_s=0.2) == [2]
        assert w[1].unreachable(wait_s=0.2) == [2]
        store.down = True  # the store's host is gone: which EP rank that is, the plugin cannot tell
        assert w[0].unreachable(wait_s=0.05) == []
    finally:
        for x in w:
            x.close()
            x.close()  # idempotent
            assert not x._thread.is_alive()  # close() waits for the beat thread


def test_the_plugin_core_sends_its_evidence_at_once() -> None:
    from controlplane.topology import Topology
    from dataplane_shim.genesis import genesis_table
    from dataplane_shim.plugin import PluginCore

    class Link:
        dropped = 0
        next_step = 0

        def __init__(self) -> None:
            self.sent: list[object] = []

        def drain(self) -> list[object]:
            return []

        def offer(self, report: object) -> None:
            self.sent.append(report)

        def go_on_from(self, step: int) -> None:
            pass

        def report(self, report, timeout: float) -> None:  # type: ignore[no-untyped-def]
            self.offer(report)

    topo = Topology(1, 4, 3)
    link = Link()
    core = PluginCore(link, topo, 2, 4, 0, genesis_table("static", topo, 2, 4).phy2log,  # type: ignore[arg-type]
                      genesis="static")
    assert not core.report_evidence()  # nothing to say
    core.peer_unreachable(2)
    assert core.report_evidence() and len(link.sent) == 1
    r = link.sent[0]
    assert list(r.unreachable_ranks) == [2] and r.steps == 0 and check_load_report(r) == ""  # type: ignore[attr-defined]
