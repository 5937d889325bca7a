"""How a node reacts to its cluster's ranks coming and going, in one place.

- Absent: a window that lacks a node's load (its agent dead, lagging, restarting or not yet heard) says nothing
  about that node's ranks: they are not idle, and no plan is made as if they were. `absent` names the nodes
  whose ranks are active in the committed head and whose load a cluster window lacks; the pipeline counts such a
  window as partial and decides nothing on it (agent.link.loadpath, agent.decision.pipeline).
- Lost: whether ranks are lost is the engine's word, not membership's alone. First-hand evidence, either of:
  - an engine process of this node left (its local link closed, agent.link.ranklink): its ranks are lost at once;
  - an engine of this node could not reach ranks of another node (LoadReport.unreachable_ranks: its EP group's
    collective or dispatch failed, and dataplane_shim.peers named the peers that stopped; the reference and
    simulated engines report the same way, chaos.simengine), and no live member holds them: their node was
    declared dead, left, or is no longer known. Verdict and evidence may come in either order: evidence is
    held `hold_s` (gossip.dead_reclaim_ms, as long as a dead member is remembered), and dropped when the node
    is alive again (its own agent runs: it knows its ranks first-hand, and repairs them itself if they left).
  So the rule is membership's "dead" (or "left", or forgotten) plus the engines' evidence from any live node:
  each node acts on its own engines' evidence, and the repair one of them proposes is voted on validity alone
  (agent.decision.voter). When a whole host dies, its peers' collectives fail and every surviving engine names its
  ranks; when only an agent dies (kill -9, an OOM kill, an upgrade, a drain) its engine ranks keep serving, no
  engine names them, nothing is repaired, and the agent that comes back resumes with no table change.
  Lost ranks active in the head are repaired (the controller's RanksLost), first and alone: the window's
  planner proposes at once, this node a window (or REPAIR_WAIT_S) later unless it is the planner (`each_window`
  counts that window: until the repair commits, windows lack the lost ranks' load and reach no controller), and
  no rebalance is decided on a window without their load.
- Back: a rank a repair drained is restored by `agent.decision.rejoin.Rejoin`, the one restore path for repaired ranks:
  at once when its engine process attaches again (first-hand evidence), else when a closed window finds its
  engine here again (`each_window`). A rank an operator drained is the operator's to restore (`emoe restore`,
  agent.decision.manual).
- Lagging: a rank whose engine stopped installing committed tables is named, once, each time it falls behind
  (agent.link.installs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

from agent.clock import Clock, Timer
from agent.commit import CommitBackend
from agent.decision.pipeline import DecisionPipeline
from agent.decision.rejoin import Rejoin
from agent.gossip.gossip_node import GossipNode
from agent.gossip.membership import LIVE, Member, MemberStatus
from agent.link.installs import Installs
from agent.link.ranklink import RankPresence
from agent.wire import plan_kind
from controlplane.controller import RanksLost
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as cpb

log = logging.getLogger(__name__)

# A node whose engines lost ranks that another node's turn is to repair waits for that node's repair one window
# or this long, whichever ends first: the planner's engines see the same collective fail and it proposes at
# once, but it may not have (its engines reported nothing, or no window closes: all the load was the lost
# node's). One second is several commit rounds on a LAN.
REPAIR_WAIT_S = 1.0


class MembershipReactions:
    """`ranks`: this node's engine ranks; `able()`: whether this node may propose a restore now (serving, not
    abstaining from consensus, a quorum of voters in view); `hold_s`: how long this node's engines' evidence
    that a rank is unreachable counts (gossip.dead_reclaim_ms)."""

    def __init__(self, node_id: str, ranks: list[int], clock: Clock, backend: CommitBackend,
                 pipeline: DecisionPipeline, gossip: GossipNode, installs: Installs, rejoin: Rejoin,
                 able: Callable[[], bool], hold_s: float = 30.0) -> None:
        self.node_id, self.ranks, self.clock, self.backend = node_id, list(ranks), clock, backend
        self.pipeline, self.gossip, self.installs, self.rejoin, self.able = pipeline, gossip, installs, rejoin, able
        self.hold_s = hold_s
        self.presence: RankPresence | None = None  # this node's engine ranks on the local link, once served
        # rank -> when this node's engines last reported it unreachable (bounded: the guard admits only EP ranks)
        self.unreachable_at: dict[int, float] = {}
        self._asked: dict[int, int] = {}  # rank -> the head version its repair was asked for at (once a version)
        self._waiting: tuple[tuple[int, ...], int] | None = None  # ranks another node's turn repairs, since window
        self._timer: Timer | None = None  # ... and until when at most (REPAIR_WAIT_S)
        self._unrepaired: set[str] = set()  # dead nodes named once as not repaired (no engine evidence)

    def serve_presence(self) -> RankPresence:
        """The local link's presence tracker for this node's ranks, reporting here."""
        self.presence = RankPresence(self.clock, self.ranks, self.ranks_left, self.ranks_back)
        return self.presence

    # ---- absent -------------------------------------------------------------------------------
    def absent(self, contributors: Sequence[str]) -> tuple[str, ...]:
        """The nodes holding ranks active in the committed head that none of `contributors` (the nodes whose
        windows a cluster window sums) holds, sorted; `rank g` for such a rank no known member holds."""
        have = set(contributors)
        covered: set[int] = set(self.ranks) if self.node_id in have else set()
        owner: dict[int, str] = {}
        for m in self.gossip.members():
            if m.node_id in have and m.status in LIVE:
                covered.update(int(g) for g in m.ranks)
            else:
                for g in m.ranks:
                    owner.setdefault(int(g), m.node_id)
        gone = set(self.backend.head.active_ranks) - covered
        if not gone:
            return ()
        return (*sorted({owner[g] for g in gone if g in owner}), *(f"rank {g}" for g in sorted(gone - owner.keys())))

    # ---- lost ---------------------------------------------------------------------------------
    def member_changed(self, m: Member) -> None:
        """A node declared dead or gone: its ranks that this node's engines reported unreachable (within
        `hold_s`) are lost, except those a live member (or this node) holds (a member that claims another's rank
        and "dies", forged or misconfigured, drains nothing); the others keep serving as far as any engine here
        says, and are named once. A node alive again drops the evidence about its ranks."""
        if m.node_id == self.node_id:
            return
        if m.status == MemberStatus.ALIVE:
            for g in m.ranks:
                self.unreachable_at.pop(int(g), None)
            self._unrepaired.discard(m.node_id)
            return
        if m.status not in (MemberStatus.DEAD, MemberStatus.LEFT):
            return
        ranks = self._unheld(m.ranks)
        now = self.clock.now()
        seen = tuple(g for g in ranks if now - self.unreachable_at.get(g, -math.inf) <= self.hold_s)
        self._lose(seen, self._planner(), f"node {m.node_id} {self._verdict(m)}, and this node's engines could not "
                                          f"reach them")
        rest = sorted(set(ranks) - set(seen))
        if rest and m.node_id not in self._unrepaired:
            self._unrepaired.add(m.node_id)
            log.warning("node %s %s; its ranks %s are not repaired: no engine of this node reported them "
                        "unreachable (its agent alone may be gone: killed, restarting, upgraded or drained while its "
                        "engines serve); windows without their load are not decided on", m.node_id, self._verdict(m),
                        rest)

    def unreachable(self, ranks: tuple[int, ...]) -> None:
        """This node's engines could not reach `ranks` (an accepted report's unreachable_ranks; its node is
        suspected by the load path): held as evidence, and those no live member holds are lost now."""
        now = self.clock.now()
        for g in ranks:
            self.unreachable_at[int(g)] = now
        lost = self._unheld(ranks)
        if lost:
            owners = {int(g): m for m in self.gossip.members() for g in m.ranks}
            held = sorted({f"{owners[g].node_id} ({self._verdict(owners[g])})" if g in owners else "no known member"
                           for g in lost})
            self._lose(lost, self._planner(), f"this node's engines could not reach them; held by {', '.join(held)}")

    def ranks_left(self, ranks: tuple[int, ...]) -> None:
        """Their engine process left (the link's first-hand evidence: no other node knows yet)."""
        self.installs.forget(ranks)
        self._lose(ranks, "", "their engine process left")

    def _unheld(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Those of `ranks` active in the head that neither this node nor a live member holds."""
        held = set(self.ranks) | {int(g) for o in self.gossip.members() if o.node_id != self.node_id
                                  and o.status in LIVE for g in o.ranks}
        active = set(self.backend.head.active_ranks)
        return tuple(sorted({int(g) for g in ranks if int(g) in active} - held))

    def _planner(self) -> str:
        return self.pipeline.turn(self.pipeline.window_seq + 1)[0]

    @staticmethod
    def _verdict(m: Member) -> str:
        return {MemberStatus.DEAD: "declared dead", MemberStatus.LEFT: "left"}.get(m.status, str(m.status.value))

    def _lose(self, ranks: tuple[int, ...], planner: str, why: str) -> None:
        """Repair `ranks` (those active in the head, each asked once a head version): `planner` proposes at once,
        this node a window or REPAIR_WAIT_S later (`_repair_now`) unless it is the planner ('')."""
        head = self.backend.head
        lost = tuple(r for r in ranks if r in head.active_ranks and self._asked.get(r) != head.version)
        if not lost:
            return
        self._asked.update(dict.fromkeys(lost, head.version))
        log.warning("ranks %s lost (%s): repairing", list(lost), why)
        if planner:
            before = self._waiting[0] if self._waiting is not None else ()
            self._waiting = (tuple(sorted({*before, *lost})), self.pipeline.window_seq)
            if self._timer is None:
                self._timer = self.clock.call_later(REPAIR_WAIT_S, self._repair_now)
        self.pipeline.step(RanksLost(lost, planner))

    def _repair_now(self) -> None:
        """The wait for the planner's repair is over: the ranks still active are repaired from here."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiting is None:
            return
        still = tuple(r for r in self._waiting[0] if r in self.backend.head.active_ranks)
        self._waiting = None
        if still:
            self.pipeline.step(RanksLost(still, ""))

    # ---- back ---------------------------------------------------------------------------------
    def ranks_back(self, ranks: tuple[int, ...]) -> None:
        """Their engine process attached again: a rank a repair drained is restored now (agent.decision.rejoin)."""
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
        """This node's own duties for a closed window, partial ones included (the pipeline runs them before its
        controller decides): a repaired rank that is back is restored; a repair the planner of another turn was to
        propose is proposed here after a window; a rank whose engine stopped installing tables is named."""
        self.rejoin.due(self.rank_here, able=self.able())
        head = self.backend.head
        if self._waiting is not None and self.pipeline.window_seq > self._waiting[1]:
            self._repair_now()  # the window this node waited for closed (partial: it reached no controller)
        for r, v, lag in self.installs.newly_lagging(head.version, self.clock.now()):
            log.warning("rank %d still runs version %d, %.1f s behind committed version %d (engine.install_lag_s "
                        "= %.1f): its engine is not installing tables", r, v, lag, head.version, self.installs.bound_s)

    def committed(self, commit: cpb.Commit, table: RoutingTable) -> None:
        self.rejoin.committed(table.version, table.parent, table.active_ranks, plan_kind(commit.plan))
        self.installs.committed(table.version, self.clock.now())
