"""The admin service's read side of a node (Status, Members, History, Explain, LoadView): NodeState's views,
kept apart from its wiring and decision loop."""

from __future__ import annotations

import numpy as np

from agent.clock import Clock
from agent.commit import CommitBackend
from agent.gossip_node import GossipNode
from agent.installs import Installs
from agent.membership import TO_PB
from agent.pipeline import DecisionPipeline
from agent.ranklink import RankPresence
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb


class AdminView:
    """Mixed into NodeState; reads what the node holds, changes nothing."""

    topology: Topology
    consensus: CommitBackend | None
    pipeline: DecisionPipeline  # the decision path: windows seen, imbalance history, replay, what it proposed
    _health: str
    installs: Installs
    presence: RankPresence | None
    clock: Clock | None

    @property
    def _backend(self) -> CommitBackend:
        raise NotImplementedError

    @property
    def _gossip(self) -> GossipNode:
        raise NotImplementedError

    def head(self) -> RoutingTable:
        return self._backend.head

    def table_at(self, version: int) -> RoutingTable | None:
        from dataplane_shim.certify import table_from_pb

        c = self._backend.committed(version)
        return None if c is None else table_from_pb(c.table, self.topology)

    def member_states(self) -> list[gpb.MemberState]:
        return [gpb.MemberState(node_id=m.node_id, address=m.address, incarnation=m.incarnation,
                                status=TO_PB[m.status], ranks=list(m.ranks)) for m in self._gossip.members()]

    def peer_versions(self) -> dict[str, int]:
        return self._backend.peer_heads()

    def role(self) -> str:
        """voter, non-voter, or learner (rebuilding after store loss) with what it waits for."""
        return self._backend.role

    def health(self) -> str:
        """SERVING, or NOT_SERVING / STARTING with the reason after a colon (a failed store, say)."""
        failure = self._backend.failure if self._health == "SERVING" and self.consensus is not None else ""
        return f"NOT_SERVING: {failure}" if failure else self._health

    def window_seq(self) -> int:
        return max(0, self.pipeline.window_seq)

    def imbalance_history(self) -> list[float]:
        return list(self.pipeline.imbalance)

    def cluster_load(self) -> np.ndarray | None:
        replay = self.pipeline.voter.replay
        return None if not replay else replay[-1]

    def commits(self, limit: int) -> list[cpb.Commit]:
        head = self.head().version
        return [c for c in reversed(self._backend.commits_since(max(0, head - limit)))]

    def explain(self, version: int) -> apb.ExplainReply | None:
        if version == 0:
            return self.pipeline.latest_explain
        rec = self.pipeline.explains.get(version)
        if rec is None:
            c = self._backend.committed(version)
            if c is not None:
                rec = apb.ExplainReply(version=version, trigger=c.plan.trigger, plan=c.plan, votes=c.votes,
                                       outcome="committed (proposed by " + (c.proposer or "?") + ")")
        return rec

    def rank_installs(self) -> list[apb.RankInstall]:
        """This node's engine ranks, ascending: the version each runs against the committed head, how long it has
        run it, since when it is behind, and whether its link is open (agent.installs)."""
        head = self.head()
        now = self.clock.now() if self.clock is not None else 0.0
        active, links = set(head.active_ranks), self.presence.open if self.presence is not None else None
        return [apb.RankInstall(rank=i.rank, installed_version=i.installed, installed_age_s=i.installed_age_s,
                                report_age_s=i.report_age_s, lag_s=i.lag_s, lagging=i.lagging,
                                attached=links is not None and links[i.rank] > 0, active=i.rank in active)
                for i in self.installs.view(head.version, now)]

    def install_lag_bound_s(self) -> float:
        return self.installs.bound_s

    def ranks_per_node(self) -> int:
        return self.topology.ranks_per_node
