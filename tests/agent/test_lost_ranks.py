"""Whether ranks are lost is the engine's word (agent.decision.reactions.MembershipReactions), on a fake clock: a node
declared dead repairs nothing unless this node's engines reported its ranks unreachable (before the verdict,
within hold_s, or after it); evidence about a node that is alive again is dropped; a node that is not the
planner proposes the repair a window, or REPAIR_WAIT_S, later; and `absent` names the nodes whose active ranks
no window covers. End to end with agent processes and live plugin ranks: tests/agent/test_absent_agent.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.clock import FakeClock
from agent.decision.reactions import REPAIR_WAIT_S, MembershipReactions
from agent.gossip.membership import Member, MemberStatus
from agent.link.installs import Installs
from controlplane.controller import RanksLost
from controlplane.table import initial_table
from controlplane.topology import Topology

TOPO = Topology(3, 2, 4)
RANKS = {"n0": (0, 1), "n1": (2, 3), "n2": (4, 5)}


class Pipeline:
    def __init__(self, planner: str = "") -> None:
        self.window_seq, self.planner, self.events = 0, planner, list[Any]()

    def turn(self, seq: int) -> tuple[str, int]:
        return self.planner, 0

    def step(self, event: Any) -> None:
        self.events.append(event)


class Gossip:
    def __init__(self) -> None:
        self.status = dict.fromkeys(RANKS, MemberStatus.ALIVE)

    def members(self) -> list[Member]:
        return [Member(n, f"{n}:1", self.status[n], 0, RANKS[n]) for n in sorted(RANKS) if n in self.status]


class Backend:
    head = initial_table(TOPO, 2, 12)


class Rejoin:
    def due(self, here: Any, able: bool) -> None:
        return None


def _reactions(planner: str = "", hold_s: float = 30.0) -> tuple[FakeClock, MembershipReactions, Pipeline, Gossip]:
    clock, pipe, gossip = FakeClock(), Pipeline(planner), Gossip()
    r = MembershipReactions("n0", [0, 1], clock, Backend(), pipe, gossip, Installs([0, 1], 10.0),  # type: ignore[arg-type]
                            Rejoin(), lambda: True, hold_s=hold_s)  # type: ignore[arg-type]
    return clock, r, pipe, gossip


def _change(r: MembershipReactions, g: Gossip, node: str, status: MemberStatus) -> None:
    g.status[node] = status
    r.member_changed(Member(node, f"{node}:1", status, 1, RANKS[node]))


def _lost(pipe: Pipeline) -> list[tuple[tuple[int, ...], str]]:
    return [(e.ranks, e.planner) for e in pipe.events if isinstance(e, RanksLost)]


def test_a_node_declared_dead_without_the_engines_word_repairs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    _, r, pipe, g = _reactions()
    with caplog.at_level(logging.WARNING, "agent"):
        _change(r, g, "n2", MemberStatus.DEAD)
        _change(r, g, "n2", MemberStatus.DEAD)  # an echo of the verdict
    assert _lost(pipe) == []
    said = [m for m in caplog.messages if "are not repaired" in m]
    assert len(said) == 1 and "[4, 5]" in said[0], caplog.messages  # said once
    _change(r, g, "n2", MemberStatus.LEFT)
    assert _lost(pipe) == []


@pytest.mark.parametrize("evidence_first", [True, False])
def test_the_engines_evidence_and_the_verdict_in_either_order_repair_once(evidence_first: bool) -> None:
    clock, r, pipe, g = _reactions()
    if evidence_first:
        r.unreachable((4, 5))  # the node is still live (suspected by the load path): not lost yet
        assert _lost(pipe) == []
        clock.advance(10.0)
        _change(r, g, "n2", MemberStatus.DEAD)
    else:
        _change(r, g, "n2", MemberStatus.DEAD)
        assert _lost(pipe) == []
        r.unreachable((4, 5))
    assert _lost(pipe) == [((4, 5), "")]
    r.unreachable((4, 5))  # more of the same evidence, the head unchanged: asked once
    _change(r, g, "n2", MemberStatus.DEAD)
    assert _lost(pipe) == [((4, 5), "")]


def test_old_evidence_and_evidence_about_a_node_alive_again_do_not_count() -> None:
    clock, r, pipe, g = _reactions(hold_s=30.0)
    r.unreachable((4, 5))
    clock.advance(31.0)  # older than hold_s at the verdict
    _change(r, g, "n2", MemberStatus.DEAD)
    assert _lost(pipe) == []
    _change(r, g, "n2", MemberStatus.ALIVE)
    r.unreachable((4,))
    _change(r, g, "n2", MemberStatus.SUSPECT)
    _change(r, g, "n2", MemberStatus.ALIVE)  # it refuted: its agent runs, it knows its ranks first-hand
    _change(r, g, "n2", MemberStatus.DEAD)  # then its agent alone goes (an upgrade)
    assert _lost(pipe) == []


def test_evidence_about_ranks_a_live_member_holds_loses_nothing() -> None:
    _, r, pipe, _ = _reactions()
    r.unreachable((2, 4))  # n1 and n2 are alive
    r.unreachable((1,))  # this node's own rank: its link says whether it left
    assert _lost(pipe) == []


def test_a_node_that_is_not_the_planner_repairs_a_window_or_a_second_later() -> None:
    clock, r, pipe, g = _reactions(planner="n1")
    _change(r, g, "n2", MemberStatus.DEAD)
    r.unreachable((4, 5))
    assert _lost(pipe) == [((4, 5), "n1")]  # n1 repairs at once; this node waits
    pipe.window_seq += 1
    r.each_window()  # a window closed (partial: it reached no controller)
    assert _lost(pipe) == [((4, 5), "n1"), ((4, 5), "")]
    clock.advance(REPAIR_WAIT_S * 2)
    assert len(_lost(pipe)) == 2  # once

    clock, r, pipe, g = _reactions(planner="n1")
    _change(r, g, "n2", MemberStatus.DEAD)
    r.unreachable((4, 5))
    clock.advance(REPAIR_WAIT_S * 0.9)
    assert len(_lost(pipe)) == 1
    clock.advance(REPAIR_WAIT_S * 0.2)  # no window closed (all the load was n2's): the wait ends anyway
    assert _lost(pipe) == [((4, 5), "n1"), ((4, 5), "")]


def test_absent_names_the_nodes_whose_active_ranks_no_window_covers() -> None:
    _, r, _, g = _reactions()
    assert r.absent(["n0", "n1", "n2"]) == ()
    assert r.absent(["n0", "n1"]) == ("n2",)  # n2 alive but lagging, or dead: its ranks are not idle
    g.status["n2"] = MemberStatus.DEAD
    assert r.absent(["n0", "n1"]) == ("n2",)
    g.status["n2"] = MemberStatus.ALIVE
    assert r.absent(["n1", "n2"]) == ("n0",)  # this node's own window missing
    del g.status["n2"]  # reaped: no known member holds ranks 4 and 5
    assert r.absent(["n0", "n1"]) == ("rank 4", "rank 5")
