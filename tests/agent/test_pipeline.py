"""The decision pipeline (agent/decision/pipeline.py) driven alone: closed cluster windows in, proposals to a stand-in
commit backend out; no NodeState, no asyncio, no network. And a node's own pipeline, fed the windows and
commits it saw in the simulated cluster, is matched proposal for proposal by a standalone one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest

from agent.admin.telemetry import Telemetry as AgentTelemetry
from agent.consensus.core import Outcome
from agent.decision.pipeline import DecisionPipeline
from agent.decision.voter import Voter
from controlplane.controller import DecisionParams, ProposalRecord, Resolution
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from elasticmoe.v1 import consensus_pb2 as cpb


@dataclass
class Backend:
    """A commit backend stand-in: it holds the head, and keeps every proposal for the test to settle."""

    head: RoutingTable
    proposed: list[tuple[RoutingTable, cpb.Plan, Callable[[Outcome], None]]] = field(default_factory=list)

    def propose(self, table: RoutingTable, plan: cpb.Plan, on_done: Callable[[Outcome], None]) -> None:
        self.proposed.append((table, plan, on_done))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class Telemetry(AgentTelemetry):
    """The agent's telemetry, disabled, that keeps the imbalance it is given."""

    def __init__(self) -> None:
        super().__init__(enabled=False)
        self.imbalance: list[float] = []
        self.spans: list[tuple[int, float]] = []

    def record_imbalance(self, x: float) -> None:
        self.imbalance.append(x)

    def commit_span(self, version: int, parent: int, votes: int, latency_ms: float) -> None:
        self.spans.append((version, latency_ms))


def _pipeline(head: RoutingTable, params: DecisionParams, voters: list[str], me: str, handover: int,
              telemetry: Telemetry | None = None) -> tuple[DecisionPipeline, Backend]:
    backend = Backend(head)
    p = DecisionPipeline(me, params, backend, Voter(params, 0.01), voters=voters, live_voters=lambda: list(voters),
                         handover_windows=handover, clock=Clock(), telemetry=telemetry or Telemetry())
    return p, backend


def _skewed(layers: int, experts: int, seed: int) -> npt.NDArray[np.uint64]:
    """One window's summed load: experts 0 and 1 of every layer take most tokens."""
    rng = np.random.default_rng(seed)
    w = np.full((layers, experts), 40.0)
    w[:, :2] = 2000.0
    return rng.poisson(w).astype(np.uint64)


def test_a_pipeline_alone_proposes_on_skewed_windows_and_hands_a_failure_back() -> None:
    topo = Topology(2, 2, 4)  # 4 ranks x 4 slots: 16 slots a layer for 8 experts
    head = genesis_table("static", topo, 4, 8)
    params = DecisionParams(window=10)
    telemetry = Telemetry()
    p, backend = _pipeline(head, params, ["a"], "a", 2, telemetry)
    for seq in range(4):
        p.close_window(seq, _skewed(4, 8, seq))
        if backend.proposed:
            break
    assert len(telemetry.imbalance) == p.window_seq + 1 and telemetry.imbalance[0] > params.theta
    assert len(backend.proposed) == 1, p.latest_explain
    table, plan, on_done = backend.proposed[0]
    assert table.version == head.version + 1 and table.parent == head.version and plan.ops
    assert p.inflight is not None and p.explains[table.version].outcome == "proposed"
    # the span the voters replay names the windows planned on (the last one's first step is in it)
    assert plan.replay_from_step <= p.window_seq * params.window < plan.replay_to_step
    on_done(Outcome(False, table.version, "lost to another table"))
    assert p.inflight is None and p.explains[table.version].outcome == "failed: lost to another table"
    recs = list(p.journal)
    assert [type(r) for r in recs] == [ProposalRecord, Resolution] and recs[1].version == table.version


def test_a_window_that_closed_without_a_lagging_nodes_load_is_not_decided_on(caplog: pytest.LogCaptureFixture) -> None:
    """A window summed without some live node's load (ClusterWindows' lag rule) shows that node's experts cold:
    it is counted and the node's own duties run, but it is not remembered for replay nor planned on; one
    warning a streak names the nodes."""
    topo = Topology(2, 2, 4)
    head = genesis_table("static", topo, 4, 8)
    params = DecisionParams(window=10)
    telemetry = Telemetry()
    p, backend = _pipeline(head, params, ["a"], "a", 2, telemetry)
    duties: list[int] = []
    p.each_window = lambda: duties.append(p.window_seq)
    caplog.set_level(logging.INFO, logger="agent")
    for seq in range(4):  # skewed enough to plan on twice over, were they whole
        p.close_window(seq, _skewed(4, 8, seq), None, ("b",))
    assert not backend.proposed and p.partial_windows == 4 and not p.voter.replay and not telemetry.imbalance
    assert duties == [0, 1, 2, 3] and p.window_seq == 3
    said = [r.getMessage() for r in caplog.records if "without the load of" in r.getMessage()]
    assert said == ["a: window 0 closed without the load of ['b'] (lagging, or absent: an agent dead, restarting or "
                    "not yet heard whose ranks are active in version 1): windows without a node's load are not "
                    "decided on (its ranks are not idle)"]
    ex = p.latest_explain  # `emoe explain` says so too, once a streak
    assert ex is not None and ex.outcome == "PARTIAL_WINDOW" and "without the load of ['b']" in ex.trigger
    for seq in range(4, 8):  # whole again: decided on as always
        p.close_window(seq, _skewed(4, 8, seq))
        if backend.proposed:
            break
    assert len(backend.proposed) == 1 and p.partial_windows == 4
    assert any("with every node's load again" in r.getMessage() for r in caplog.records)


def test_a_commit_is_logged_and_its_span_carries_the_proposal_latency() -> None:
    """The commit span lasts from this node's proposal to the commit (it was 0.0 whatever the latency); every
    node logs the commits it learns at INFO with what they move."""
    from dataplane_shim.certify import certified_commit

    topo = Topology(2, 2, 4)
    head = genesis_table("static", topo, 4, 8)
    telemetry = Telemetry()
    p, backend = _pipeline(head, DecisionParams(window=10), ["a"], "a", 2, telemetry)
    clock = p.clock
    assert isinstance(clock, Clock)
    for seq in range(4):
        p.close_window(seq, _skewed(4, 8, seq))
        if backend.proposed:
            break
    table, plan, on_done = backend.proposed[0]
    clock.t += 0.25  # a quarter second to commit
    commit = certified_commit(table, ["a"], 1)
    commit.plan.CopyFrom(plan)
    commit.proposer = "a"
    backend.head = table
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("agent.decision.pipeline")  # (the agent's CLI tests may have set its level and propagation)
    level, disabled = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False
    try:
        on_done(Outcome(True, table.version, "", [], 0.25, commit))
        p.on_commit(commit, table, p.window_seq)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    assert telemetry.spans == [(table.version, pytest.approx(250.0))]
    line = next(m for m in said if "committed version" in m)
    assert f"committed version {table.version} (rebalance, proposed by a): {len(plan.ops)} operations" in line
    assert " MB to copy" in line


def test_a_pipeline_that_does_not_plan_this_window_proposes_nothing() -> None:
    topo = Topology(2, 2, 4)
    head = genesis_table("static", topo, 4, 8)
    params = DecisionParams(window=10)
    planner = "a" if p_turn(head, ["a", "b"]) == "a" else "b"
    other = "b" if planner == "a" else "a"
    p, backend = _pipeline(head, params, ["a", "b"], other, 1000)  # the turn never passes on
    for seq in range(4):
        p.close_window(seq, _skewed(4, 8, seq))
    assert backend.proposed == [] and p.turn(4)[0] == planner


def p_turn(head: RoutingTable, voters: list[str]) -> str:
    from agent.consensus.paxos import round0_owner

    return round0_owner(head.version + 1, voters)


def test_a_standalone_pipeline_makes_the_nodes_decisions() -> None:
    """One simulated node (it plans every window, commits alone): the windows and commits its pipeline saw,
    replayed into a pipeline of its own with a stand-in backend, give the same proposals in the same order."""
    from chaos.simcluster import Shape, SimCluster

    c = SimCluster(1, Shape(layers=4, experts=8, ranks_per_node=4, slots_per_rank=4), seed=5)
    st = c.states["n00"]
    genesis = st.head()
    seen: list[tuple[str, object]] = []  # what the node's pipeline was fed, in order
    st.pipeline.hooks.window_closed.append(lambda seq, total, samples: seen.append(("window", (seq, total, samples))))

    def proposing(table: RoutingTable) -> Callable[[Outcome], None]:
        seen.append(("propose", table))
        return lambda outcome: seen.append(("done", outcome))

    st.pipeline.hooks.proposing.append(proposing)
    st.consensus.on_commit(lambda commit, table: seen.append(
        ("commit", (commit, table, st.load.newest_reported()))))
    c.run(10.0)
    node_proposals = [t for k, t in seen if k == "propose"]
    assert len(node_proposals) >= 2

    p, backend = _pipeline(genesis, st.pipeline.params, ["n00"], "n00", st.cfg.decision.handover_windows)
    pending: dict[int, Callable[[Outcome], None]] = {}
    known = 0
    for kind, what in seen:
        if kind == "window":
            seq, total, samples = what  # type: ignore[misc]
            p.close_window(seq, total, samples)
        elif kind == "done":
            assert isinstance(what, Outcome)
            pending.pop(what.version)(what)
        elif kind == "commit":
            commit, table, newest = what  # type: ignore[misc]
            backend.head = table
            p.on_commit(commit, table, newest)
        for t, _, on_done in backend.proposed[known:]:
            pending[t.version] = on_done
        known = len(backend.proposed)
    mine = [t for t, _, _ in backend.proposed]
    assert [(t.version, t.digest) for t in mine] == [(t.version, t.digest) for t in node_proposals]  # type: ignore[attr-defined]
    assert [type(r).__name__ for r in p.journal] == [type(r).__name__ for r in st.pipeline.journal]


def test_the_bench_elastic_policy_and_an_agent_make_the_same_decisions() -> None:
    """`emoe bench`'s elastic policy (bench/policies.py Elastic) runs the agents' own DecisionPipeline: fed the
    cluster windows a simulated agent closed, it proposes the same versions with the same operations, in the
    same order, as that agent did."""
    import numpy as np

    from agent.wire import ops_from_pb
    from bench.policies import Elastic
    from chaos.simcluster import Shape, SimCluster

    c = SimCluster(1, Shape(layers=4, experts=8, ranks_per_node=4, slots_per_rank=4), seed=5)
    st = c.states["n00"]
    genesis = st.head()
    windows: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    st.pipeline.hooks.window_closed.append(lambda seq, total, samples: windows.append((seq, total, samples)))
    c.run(10.0)
    commits = [cm for cm in st.consensus.commits_since(genesis.version)]
    agent = [(cm.table.version, ops_from_pb(cm.plan.ops)) for cm in commits]
    assert len(agent) >= 2

    W = st.pipeline.params.window
    bench = Elastic(W, params={f: getattr(st.pipeline.params, f) for f in ("theta", "tau", "fast_theta",
                                                                           "max_ops", "replay_windows",
                                                                           "rollback_windows", "expert_bytes",
                                                                           "sample_every", "budget_windows")})
    bench.start(genesis, np.zeros((0, 4, 8), np.uint32), [])
    proposed: list[RoutingTable] = []
    bench.pipeline.hooks.proposing.append(lambda t: proposed.append(t) or (lambda outcome: None))
    assert [s for s, *_ in windows] == list(range(windows[0][0], windows[0][0] + len(windows)))
    # the sim's engines send every step (W = 2, sample_every 1): the bench's trace is those steps
    assert st.pipeline.params.sample_every == 1 and all(samples is not None for *_, samples in windows)
    bench.seq = windows[0][0]
    for seq, _, samples in windows:
        seen = np.zeros((W * (seq + 1), 4, 8), np.uint32)
        seen[W * seq:W * (seq + 1)] = samples
        bench.on_window(W * seq, W * (seq + 1), seen)
    assert [(d["version"], d["ops"]) for d in bench.decisions] == [(v, len(ops)) for v, ops in agent]
    assert [t.digest for t in proposed] == [bytes(cm.table.content_hash) for cm in commits]  # the same tables
