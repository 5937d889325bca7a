"""An operator's proposal (agent/decision/manual.py ManualPath: `emoe propose`, drain, restore, and rejoin's restore) is
consumed by the pipeline like an automatic one (issue 50, finding 3: one consumer of the controller's Ready):
its Explain is counted (the `emoe_decisions` counter, the `explained` hook, `emoe explain` for version 0 where
nothing was proposed) and its lifecycle moves reach the transition telemetry. Before, the manual path had its
own consumer, which counted none of it. Driven through ManualPath over the pipeline tests' stand-ins."""

from __future__ import annotations

import ast
import asyncio
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from agent.admin import metrics
from agent.consensus.core import Outcome
from agent.decision.manual import ManualPath
from agent.decision.pipeline import DecisionPipeline
from agent.decision.voter import Voter
from controlplane.controller import DecisionParams, Explain
from controlplane.decision import DecisionOutcome
from controlplane.elastic import plan_drain
from controlplane.ops import Replicate, apply_ops
from controlplane.planner import Reason
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from elasticmoe.v1 import admin_pb2 as apb
from tests.agent.test_pipeline import Backend, Clock, Telemetry  # the pipeline tests' stand-ins

TOPO = Topology(2, 2, 4)  # 4 ranks x 4 slots: 16 slots a layer for 8 experts


class Transitions(Telemetry):
    """The pipeline tests' telemetry, keeping the lifecycle moves it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.transitions: list[tuple[str, str]] = []

    def record_transition(self, kind: str, state: str) -> None:
        self.transitions.append((kind, str(state)))


def _manual(head: RoutingTable) -> tuple[ManualPath, DecisionPipeline, Backend, Transitions, list[Explain]]:
    params = DecisionParams(window=10)
    backend, telemetry = Backend(head), Transitions()
    p = DecisionPipeline("a", params, backend, Voter(params, 0.01), voters=["a"], live_voters=lambda: ["a"],
                         handover_windows=2, clock=Clock(), telemetry=telemetry)
    seen: list[Explain] = []
    p.hooks.explained.append(seen.append)
    # ManualPath's backend, switch and clock: the stand-in backend (head, propose); no pause is written; nothing
    # is in flight, so it never waits on the clock
    path = ManualPath(p, backend, None, Clock())  # type: ignore[arg-type]
    return path, p, backend, telemetry, seen


def _decisions(p: DecisionPipeline) -> dict[str, float]:
    """The `emoe_decisions` counter of the agent's Prometheus page, as rendered from the pipeline's counts."""
    snap = metrics.Snapshot(version=1, serving=True, paused=False, window_seq=0, imbalance=None, since_commit=0.0,
                            members=Counter(), peer_versions={},
                            outcomes=dict(p.outcomes))
    page = metrics.render(snap).decode()
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(page) if f.name == "emoe_decisions"
            for s in f.samples if s.name == "emoe_decisions_total"}


def test_an_operators_forced_proposal_is_counted_and_its_transition_recorded() -> None:
    head = genesis_table("static", TOPO, 4, 8)
    path, p, backend, telemetry, seen = _manual(head)

    async def propose() -> apb.ProposeReply:
        task = asyncio.ensure_future(path.propose_manual((Replicate(0, 0, 3),), True))
        for _ in range(100):
            if backend.proposed:
                break
            await asyncio.sleep(0)
        (table, plan, on_done), = backend.proposed
        assert plan.forced and plan.trigger.startswith("manual --force: ")
        on_done(Outcome(True, table.version, ""))
        return await task

    reply = asyncio.run(propose())
    assert reply.committed and reply.version == head.version + 1, reply
    assert p.outcomes[DecisionOutcome.PROPOSED] == 1, dict(p.outcomes)
    assert [e.outcome for e in seen] == [DecisionOutcome.PROPOSED]
    assert ("manual", "PROPOSED") in telemetry.transitions, telemetry.transitions
    assert _decisions(p) == {"PROPOSED": 1.0}
    assert p.explains[head.version + 1].outcome == "committed"


def test_an_operators_refused_proposal_is_counted_and_explained() -> None:
    head = genesis_table("static", TOPO, 4, 8)
    path, p, backend, telemetry, seen = _manual(head)
    reply = asyncio.run(path.propose_manual((Replicate(0, 0, 3),), False))  # unforced, no window: no gain
    assert not reply.committed and not backend.proposed
    assert reply.reason.startswith(f"manual not proposed by the decision core: {Reason.GAIN_BELOW_TAU}"), reply
    assert p.outcomes[Reason.GAIN_BELOW_TAU] == 1, dict(p.outcomes)
    assert [e.outcome for e in seen] == [Reason.GAIN_BELOW_TAU]
    assert _decisions(p) == {str(Reason.GAIN_BELOW_TAU): 1.0}
    ex = p.latest_explain  # `emoe explain` (version 0) says why the operator's proposal was not made
    assert ex is not None and ex.outcome == Reason.GAIN_BELOW_TAU and ex.trigger.startswith("manual"), ex
    assert telemetry.transitions == []  # nothing was proposed: no lifecycle to move


def test_a_rejoin_restore_is_counted_and_its_transition_recorded() -> None:
    genesis = genesis_table("static", TOPO, 4, 8)
    head = apply_ops(genesis, plan_drain(genesis, 3))  # rank 3 drained: rejoin restores it when it is back
    assert 3 not in head.active_ranks
    path, p, backend, telemetry, seen = _manual(head)
    assert path.restore_now(3) == ""
    (table, plan, _), = backend.proposed
    assert 3 in table.active_ranks and plan.forced
    assert p.outcomes[DecisionOutcome.PROPOSED] == 1, dict(p.outcomes)
    assert [e.outcome for e in seen] == [DecisionOutcome.PROPOSED]
    assert telemetry.transitions == [("manual", "PROPOSED")]


def test_every_ready_in_agent_is_consumed_by_perform() -> None:
    """Nothing in agent/ takes a Ready from the controller but to hand it to `perform` (a second consumer, as
    the manual path was, skips what `perform` counts)."""
    root = Path(__file__).resolve().parents[2] / "agent"
    stray: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        consumed = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                    and n.func.attr == "perform" for a in n.args[:1]}
        stray += [f"{path.relative_to(root.parent)}:{n.lineno}" for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step"
                  and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "controller"
                  and id(n) not in consumed]
    assert not stray, f"a controller's Ready consumed outside DecisionPipeline.perform at {stray}"
