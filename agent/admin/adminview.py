"""The admin service's read side of a node (Status, Members, History, Explain, LoadView, Placement): one object
over the node's parts, built complete once they exist (agent.state.NodeState); it changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agent.admin.admin import copy_bytes
from agent.clock import Clock
from agent.commit import CommitBackend, PauseSwitch
from agent.decision.pipeline import DecisionPipeline
from agent.fingerprint import FingerprintCheck
from agent.gossip.gossip_node import GossipNode
from agent.gossip.membership import TO_PB
from agent.link.installs import Installs
from agent.link.loadpath import LoadPath
from agent.link.ranklink import RankPresence
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from elasticmoe.codec import table_from_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb


class AdminView:
    """Reads what the node's parts hold. `lifecycle()`: the node's own STARTING / SERVING / NOT_SERVING;
    `presence()`: its engine ranks' local links, once it serves them (None before); `switch`: the cluster's pause
    switch; `fingerprints`: this node's cluster fingerprint against its members'."""

    def __init__(self, node_id: str, topology: Topology, backend: CommitBackend, gossip: GossipNode,
                 pipeline: DecisionPipeline, load: LoadPath, installs: Installs, clock: Clock,
                 lifecycle: Callable[[], str], presence: Callable[[], RankPresence | None], switch: PauseSwitch,
                 fingerprints: FingerprintCheck, genesis: RoutingTable) -> None:
        """`genesis`: version 1, the engines' boot placement (it has no commit record to read it from)."""
        self.node_id, self.topology, self.backend, self.gossip = node_id, topology, backend, gossip
        self.genesis = genesis
        self.pipeline, self.load, self.installs, self.clock = pipeline, load, installs, clock
        self.lifecycle, self.presence, self.switch, self.fingerprints = lifecycle, presence, switch, fingerprints

    def head(self) -> RoutingTable:
        return self.backend.head

    def table_at(self, version: int) -> RoutingTable | None:
        c = self.backend.committed(version)
        if c is None:
            return self.genesis if version == self.genesis.version else None
        return table_from_pb(c.table, self.topology)

    def member_states(self) -> list[gpb.MemberState]:
        return [gpb.MemberState(node_id=m.node_id, address=m.address, incarnation=m.incarnation,
                                status=TO_PB[m.status], ranks=list(m.ranks)) for m in self.gossip.members()]

    def peer_versions(self) -> dict[str, int]:
        return self.backend.peer_heads()

    def role(self) -> str:
        """voter, non-voter, or learner (rebuilding after store loss) with what it waits for."""
        return self.backend.role

    def health(self) -> str:
        """SERVING, or NOT_SERVING / STARTING with the reason after a colon (a failed store, a config whose cluster
        fingerprint differs from the voters')."""
        state = self.lifecycle()
        failure = (self.backend.failure or self.fingerprints.verdict()) if state == "SERVING" else ""
        return f"NOT_SERVING: {failure}" if failure else state

    def paused(self) -> bool:
        return self.pipeline.paused

    def pause_record(self) -> cpb.ControlCommit | None:
        """The cluster's pause switch: the newest certified record this node knows (None: never written)."""
        return self.switch.record

    def planner(self) -> str:
        """The node planning the next version (the planning turn); "" when every node plans."""
        return self.pipeline.planner()

    def fingerprint(self) -> gpb.Fingerprint:
        return self.fingerprints.mine

    def fingerprint_mismatches(self) -> list[apb.FingerprintMismatch]:
        """The live members whose cluster fingerprint differs from this node's, with the differing fields."""
        return [apb.FingerprintMismatch(node_id=n, fields=f) for n, f in self.fingerprints.mismatches()]

    def decision_outcomes(self) -> dict[str, int]:
        """The controller's decisions since start, by outcome (PROPOSED, BELOW_THETA, GAIN_BELOW_TAU, ...)."""
        return dict(self.pipeline.outcomes)

    def plan_stats(self) -> tuple[int, float, float]:
        """Rebalances planned since start, their wall seconds in all, and the last one's."""
        p = self.pipeline
        return p.plans, p.plan_seconds, p.last_plan_seconds

    def bytes_moved(self) -> int:
        """Weight bytes the commits this node learned since start copy."""
        return self.pipeline.bytes_moved

    def reports_dropped(self) -> int:
        """Load reports this node's engines dropped before sending them (an agent too slow or absent)."""
        return sum(self.load.dropped.values())

    def reports_unsampled(self) -> int:
        """Load reports used for their totals only (no sampled steps, or sampled at another rate)."""
        return self.load.unsampled

    def reports_refused(self) -> dict[str, int]:
        """Load reports refused since start by code (agent.link.reportguard: another node's rank, a version past the
        head, counts past the engine's batch, ...)."""
        return {code.value: n for code, n in self.load.guard.refused.items()}

    def windows_refused(self) -> dict[str, int]:
        """Peers' load windows refused since start by code (agent.gossip.windowguard.Refusal: unsigned or badly signed
        under mTLS, from an earlier incarnation of its node, from the future)."""
        return {code.value: n for code, n in self.gossip.load.refused.items()}

    def control_refusals(self) -> dict[str, int]:
        """Control records (pause/resume) this node refused since start, by consensus.proto ControlRefusal name
        (agent.consensus.control: not from their writer, an unknown writer, a finish without the writer's
        signature, a certified record that does not check, ...)."""
        return dict(self.switch.refused)

    def partial_windows(self) -> int:
        """Cluster windows closed without a lagging live node's load (not decided on) since start."""
        return self.pipeline.partial_windows

    def seconds_since_commit(self) -> float:
        """Since this node learned its newest commit (since its start, before one)."""
        return max(0.0, self.clock.now() - self.pipeline.committed_at)

    def window_seq(self) -> int:
        return max(0, self.pipeline.window_seq)

    def imbalance_history(self) -> list[float]:
        return list(self.pipeline.imbalance)

    def cluster_load(self) -> np.ndarray | None:
        return self.pipeline.latest_window()

    def commits(self, limit: int) -> list[cpb.Commit]:
        head = self.head().version
        return [c for c in reversed(self.backend.commits_since(max(0, head - limit)))]

    def explain(self, version: int) -> apb.ExplainReply | None:
        if version == 0:
            return self.pipeline.latest_explain
        rec = self.pipeline.explains.get(version)
        if rec is None:
            c = self.backend.committed(version)
            if c is not None:
                parent = self.table_at(int(c.table.parent)) if c.table.parent else None
                size = copy_bytes(None if parent is None else parent.phy2log, c, self.expert_bytes())
                rec = apb.ExplainReply(version=version, trigger=c.plan.trigger, plan=c.plan, votes=c.votes,
                                       outcome="committed (proposed by " + (c.proposer or "?") + ")",
                                       copy_bytes=size)
        return rec

    def window_steps(self) -> int:
        """Engine steps per load window (decision.window)."""
        return self.pipeline.params.window

    def expert_bytes(self) -> int:
        """One expert's weight bytes (cluster.expert_bytes): what one copied slot moves."""
        return self.pipeline.params.expert_bytes

    def rank_installs(self) -> list[apb.RankInstall]:
        """This node's engine ranks, ascending: the version each runs against the committed head, how long it has
        run it, since when it is behind, and whether its link is open (agent.link.installs)."""
        head = self.head()
        presence = self.presence()
        active, links = set(head.active_ranks), presence.open if presence is not None else None
        return [apb.RankInstall(rank=i.rank, installed_version=i.installed, installed_age_s=i.installed_age_s,
                                report_age_s=i.report_age_s, lag_s=i.lag_s, lagging=i.lagging,
                                attached=links is not None and links[i.rank] > 0, active=i.rank in active,
                                error=i.error)
                for i in self.installs.view(head.version, self.clock.now())]

    def install_lag_bound_s(self) -> float:
        return self.installs.bound_s

    def ranks_per_node(self) -> int:
        return self.topology.ranks_per_node
