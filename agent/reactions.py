"""How a node reacts to its cluster's ranks coming and going, in one place.

- Lost: a node declared dead (gossip's member change) or an engine process that left (its local link closed,
  agent.ranklink) -> its ranks active in the head are repaired (the controller's RanksLost: the window's
  planner proposes at once, this node a window later unless it is the planner).
- Back: a rank a repair drained is restored by `agent.rejoin.Rejoin`, the one restore path for repaired ranks:
  at once when its engine process attaches again (first-hand evidence), else when a closed window finds its
  engine here again (`each_window`). A rank an operator drained is the operator's to restore (`emoe restore`,
  agent.manual).
- Lagging: a rank whose engine stopped installing committed tables is named, once, each time it falls behind
  (agent.installs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.clock import Clock
from agent.commit import CommitBackend
from agent.gossip_node import GossipNode
from agent.installs import Installs
from agent.membership import Member, MemberStatus
from agent.pipeline import DecisionPipeline
from agent.ranklink import RankPresence
from agent.rejoin import Rejoin
from agent.wire import plan_kind
from controlplane.controller import RanksLost
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as cpb

log = logging.getLogger("emoe.agent")


class MembershipReactions:
    """`ranks`: this node's engine ranks; `able()`: whether this node may propose a restore now (serving, not
    abstaining from consensus, a quorum of voters in view)."""

    def __init__(self, node_id: str, ranks: list[int], clock: Clock, backend: CommitBackend,
                 pipeline: DecisionPipeline, gossip: GossipNode, installs: Installs, rejoin: Rejoin,
                 able: Callable[[], bool]) -> None:
        self.node_id, self.ranks, self.clock, self.backend = node_id, list(ranks), clock, backend
        self.pipeline, self.gossip, self.installs, self.rejoin, self.able = pipeline, gossip, installs, rejoin, able
        self.presence: RankPresence | None = None  # this node's engine ranks on the local link, once served

    def serve_presence(self) -> RankPresence:
        """The local link's presence tracker for this node's ranks, reporting here."""
        self.presence = RankPresence(self.clock, self.ranks, self.ranks_left, self.ranks_back)
        return self.presence

    # ---- lost ---------------------------------------------------------------------------------
    def member_changed(self, m: Member) -> None:
        """A node declared dead: its ranks are lost, except those a live member (or this node) holds (a member
        that claims another's rank and "dies", forged or misconfigured, drains nothing). The controller proposes
        the repair (drain the ranks, reload experts left without a replica); shims mask the ranks meanwhile."""
        if m.status != MemberStatus.DEAD or m.node_id == self.node_id:
            return
        held = set(self.ranks) | {int(g) for o in self.gossip.members() if o.node_id != m.node_id
                                  and o.status == MemberStatus.ALIVE for g in o.ranks}
        claimed = set(m.ranks) & set(self.backend.head.active_ranks)
        self._lose(tuple(sorted(claimed - held)), self.pipeline.turn(self.pipeline.window_seq + 1)[0],
                   f"node {m.node_id} declared dead")

    def ranks_left(self, ranks: tuple[int, ...]) -> None:
        """Their engine process left (the link's first-hand evidence: no other node knows yet)."""
        self.installs.forget(ranks)
        self._lose(ranks, "", "their engine process left")

    def _lose(self, ranks: tuple[int, ...], planner: str, why: str) -> None:
        """Repair `ranks` (those active in the head): `planner` proposes at once, this node a window later unless
        it is the planner ('')."""
        lost = tuple(r for r in ranks if r in self.backend.head.active_ranks)
        if lost:
            log.warning("ranks %s lost (%s): repairing", list(lost), why)
            self.pipeline.step(RanksLost(lost, planner))

    # ---- back ---------------------------------------------------------------------------------
    def ranks_back(self, ranks: tuple[int, ...]) -> None:
        """Their engine process attached again: a rank a repair drained is restored now (agent.rejoin)."""
        able = self.able()
        for r in ranks:
            if r not in self.backend.head.active_ranks:
                self.rejoin.back(r, able)

    def rank_here(self, r: int) -> bool:
        """First-hand evidence that rank r's engine runs: its link to this agent is open, or it reported load
        within the last two seconds."""
        if self.presence is not None and self.presence.open[r] > 0:
            return True
        t = self.installs.last_report(r)
        return t is not None and self.clock.now() - t < 2.0

    # ---- each window, each commit ---------------------------------------------------------------
    def each_window(self) -> None:
        """This node's own duties for a closed window (the pipeline runs them before its controller decides): a
        repaired rank that is back is restored; a rank whose engine stopped installing tables is named."""
        self.rejoin.due(self.rank_here, able=self.able())
        head = self.backend.head
        for r, v, lag in self.installs.newly_lagging(head.version, self.clock.now()):
            log.warning("rank %d still runs version %d, %.1f s behind committed version %d (engine.install_lag_s "
                        "= %.1f): its engine is not installing tables", r, v, lag, head.version, self.installs.bound_s)

    def committed(self, commit: cpb.Commit, table: RoutingTable) -> None:
        self.rejoin.committed(table.version, table.parent, table.active_ranks, plan_kind(commit.plan))
        self.installs.committed(table.version, self.clock.now())
