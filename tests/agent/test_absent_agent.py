"""An absent agent is not an idle node (issue 49, finding 5): 3 agent processes (chaos.localcluster), each beside
two live engine ranks (one dataplane_shim.plugin.PluginCore + LinkThread per rank over its node's shim socket,
stepped in lockstep as an EP group steps). Each rank reports the tokens its own experts took: with every rank's
load the cluster is balanced; without one node's, its ranks look idle and a rebalance onto them looks worth
making (at 67b8e70 the survivors repaired node3's serving ranks and rebalanced onto planned-idle ranks).

1. kill -9 of node3's agent for longer than the dead-node timeout while its ranks keep serving (their reports
   go nowhere): no commit while it is gone, and none after it is back, just because it was gone.
2. kill -9 of node3's agent and of its ranks (their plugins stop): membership's "dead" alone repairs nothing;
   once the other nodes' plugins report them unreachable (a failed EP collective: PluginCore.peer_unreachable,
   report_evidence), exactly one commit, the repair that drains ranks 4 and 5."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from chaos.localcluster import LocalCluster, stable_ports
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import PluginCore
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb
from tests.adminclient import status
from tests.conftest import until

pytestmark = pytest.mark.slow

L, E, NODES, RPN, S = 2, 12, 3, 2, 4
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": 2}
DECISION = {"window": 10, "sample_every": 5, "budget_windows": 1, "theta": 1.05, "tau": 0.01}
GONE = 2  # node3, ranks 4 and 5
GONE_RANKS = [GONE * RPN + i for i in range(RPN)]


class Ranks:
    """One plugin core per EP rank, stepped in lockstep on a thread (reports, the MIN agreement, installs).
    Static genesis puts experts 2g and 2g + 1 on rank g; rank g reports 30 tokens a step for each of them."""

    def __init__(self, c: LocalCluster) -> None:
        topo = Topology(NODES, RPN, S)
        boot = genesis_table("static", topo, L, E).phy2log
        G = topo.ranks
        self.links = [LinkThread(c.shim_socket(g // RPN), 1, shim_id=f"rank{g}", ranks=[g]) for g in range(G)]
        self.cores = [PluginCore(link, topo, L, E, g, boot, genesis="static", report_every=5,  # type: ignore[arg-type]
                                 sample_every=5) for g, link in enumerate(self.links)]
        self.load = []
        for g in range(G):
            mine = np.zeros((L, E), np.int64)
            for layer in range(L):
                held = boot[layer, g * S:(g + 1) * S]
                mine[layer, held[held >= 0]] = 30
            self.load.append(mine)
        self.running = set(range(G))
        self.evidence: list[int] = []  # ranks the running ones report unreachable at their next step
        self.lock = threading.Lock()
        self.steps, self.installed = 0, 1
        self.stop, self.errors = threading.Event(), list[BaseException]()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                with self.lock:
                    live, told, self.evidence = sorted(self.running), self.evidence, []
                for g in live:
                    core = self.cores[g]
                    for r in told:  # a collective of the EP group failed: the plugin names the peers gone
                        core.peer_unreachable(r)
                    if told:
                        core.report_evidence()
                    offs = core.sampled(1)
                    core.add_load(self.load[g], 1, self.load[g][None] if offs else None)
                    core.maybe_report()
                red = np.min([self.cores[g].agreement_vector() for g in live], axis=0)
                for g in live:
                    if (t := self.cores[g].decide(red)) is not None:
                        self.cores[g].installed(t.version)
                        self.installed = t.version
                self.steps += 1
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.errors.append(e)

    def kill(self, ranks: list[int]) -> None:
        """Their processes die: no step, no report, their links close."""
        with self.lock:
            self.running -= set(ranks)
        for g in ranks:
            self.links[g].close()

    def unreachable(self, ranks: list[int]) -> None:
        with self.lock:
            self.evidence = list(ranks)

    def close(self) -> None:
        self.stop.set()
        self._th.join(5)
        for g in sorted(self.running):
            self.links[g].close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Ranks]]:
    base: Path = tmp_path_factory.mktemp("absent")
    # ports below the ephemeral range: node3's agent is restarted on its own port
    c = LocalCluster(NODES, base, SHAPE, ports=stable_ports(NODES), sections={"decision": DECISION},
                     log_level="INFO")
    with c.running():
        ranks = Ranks(c)
        try:
            yield c, ranks
        finally:
            ranks.close()


def _heads(c: LocalCluster, which: list[int]) -> list[int]:
    return [int(status(c.addresses[k]).committed_version) for k in which]


def _windows(c: LocalCluster, k: int) -> int:
    return int(status(c.addresses[k]).window_seq)


def _sees(c: LocalCluster, k: int, node: str, st: int) -> bool:
    return any(m.node_id == node and m.status == st for m in status(c.addresses[k]).members)


def _history(c: LocalCluster, k: int, past: int) -> list[apb.HistoryEntry]:
    with grpc.insecure_channel(c.addresses[k]) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
        entries = stub.History(apb.HistoryRequest(limit=1000), timeout=10).entries
    return sorted((h for h in entries if h.version > past), key=lambda h: h.version)


def _windows_pass(c: LocalCluster, which: list[int], n: int, timeout: float = 30.0) -> None:
    """Wait until each of `which` has closed `n` more windows."""
    start = {k: _windows(c, k) for k in which}
    until(f"{n} windows closed on {[c.ids[k] for k in which]}",
          lambda: all(_windows(c, k) >= start[k] + n for k in which), timeout=timeout)


def _describe(hs: list[apb.HistoryEntry]) -> str:
    return "; ".join(f"v{h.version} {cpb.PlanKind.Name(h.plan.kind).removeprefix('PLAN_').lower()} "
                     f"{len(h.plan.ops)} ops {h.copy_bytes / 1e6:.1f} MB ({h.plan.trigger[:80]})" for h in hs) or "none"


def _settled(c: LocalCluster, ranks: Ranks) -> int:
    """Every agent serves and closes windows with every rank's load; the committed head they agree on."""
    everyone = list(range(NODES))
    _windows_pass(c, everyone, 5)
    heads = _heads(c, everyone)
    assert len(set(heads)) == 1, f"heads differ: {heads}"
    assert not ranks.errors, ranks.errors
    return heads[0]


def test_an_agent_killed_beside_serving_ranks_causes_no_commit(cluster: tuple[LocalCluster, Ranks]) -> None:
    c, ranks = cluster
    h0 = _settled(c, ranks)
    survivors = [k for k in range(NODES) if k != GONE]
    c.kill(GONE)  # kill -9 of the agent alone: its ranks keep stepping and reporting (to nothing)
    t0 = time.monotonic()
    until(f"the survivors declare {c.ids[GONE]} dead",
          lambda: all(_sees(c, k, c.ids[GONE], gpb.DEAD) for k in survivors), timeout=30)
    dead_after = time.monotonic() - t0
    _windows_pass(c, survivors, 15)  # windows close at the survivors while it is dead
    gone_for = time.monotonic() - t0
    during = _history(c, survivors[0], h0)
    c.start(GONE)
    c.wait_healthy(which=[GONE])
    until(f"{c.ids[GONE]} alive again on every node",
          lambda: all(not _sees(c, k, c.ids[GONE], gpb.DEAD) and not _sees(c, k, c.ids[GONE], gpb.SUSPECT)
                      for k in range(NODES)), timeout=30)
    _windows_pass(c, list(range(NODES)), 20)  # it is back: windows with every rank's load again
    after = _history(c, survivors[0], h0)
    print(f"\nagent {c.ids[GONE]} killed: declared dead after {dead_after:.1f} s, back after {gone_for:.1f} s; "
          f"commits while gone: {_describe(during)}; commits since (through its return): {_describe(after)}")
    assert during == [], f"committed while {c.ids[GONE]}'s agent was gone (its ranks served): {_describe(during)}"
    assert after == [], f"committed after {c.ids[GONE]}'s agent came back: {_describe(after)}"
    assert _heads(c, list(range(NODES))) == [h0] * NODES
    assert not ranks.errors, ranks.errors


def test_ranks_the_engines_lose_with_their_agent_are_repaired_once(cluster: tuple[LocalCluster, Ranks]) -> None:
    c, ranks = cluster
    h0 = _settled(c, ranks)
    survivors = [k for k in range(NODES) if k != GONE]
    c.kill(GONE)  # the host dies: its agent and its engine ranks
    ranks.kill(GONE_RANKS)
    until(f"the survivors declare {c.ids[GONE]} dead",
          lambda: all(_sees(c, k, c.ids[GONE], gpb.DEAD) for k in survivors), timeout=30)
    _windows_pass(c, survivors, 10)
    before = _history(c, survivors[0], h0)
    # the engines' word: the surviving ranks' collective failed and their plugins name the ranks gone
    ranks.unreachable(GONE_RANKS)
    until("a commit after the engines' evidence", lambda: min(_heads(c, survivors)) > h0, timeout=30)
    _windows_pass(c, survivors, 20)
    after = _history(c, survivors[0], h0)
    print(f"\n{c.ids[GONE]}'s agent and ranks killed: commits before the engines' evidence: {_describe(before)}; "
          f"after: {_describe(after)}")
    assert before == [], f"repaired on membership's word alone: {_describe(before)}"
    assert [h.plan.kind for h in after] == [cpb.PLAN_REPAIR], f"expected one repair: {_describe(after)}"
    with grpc.insecure_channel(c.addresses[survivors[0]]) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
        active = list(stub.Placement(apb.PlacementRequest(layer=-1), timeout=10).table.active_ranks)
    assert not set(GONE_RANKS) & set(active), active
    assert not ranks.errors, ranks.errors
