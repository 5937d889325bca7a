"""NodeState: one node's live state and the glue between its parts.

Load path: shim reports -> LoadPath (LocalWindows -> gossip -> ClusterWindows) -> DecisionPipeline.close_window.
Decision path: DecisionPipeline (agent.pipeline: controller, planning turn, Ready loop) -> (the window's planner
only) the commit backend's propose -> commit.
Commit path: backend.on_commit -> DecisionPipeline.on_commit (controller: TableCommitted) -> MembershipReactions
(rejoin, installs) -> shims (WatchTables stream).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from agent.adminview import AdminView
from agent.commit import CommitBackend
from agent.config import AgentConfig
from agent.installs import Installs
from agent.loadpath import LoadPath
from agent.manual import ManualPath
from agent.pipeline import DecisionPipeline
from agent.reactions import MembershipReactions
from agent.rejoin import Rejoin
from agent.voter import Voter
from controlplane.controller import DecisionParams
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as cpb

if TYPE_CHECKING:
    from agent.clock import Clock
    from agent.gossip_node import GossipNode
    from agent.ranklink import RankPresence
    from agent.store import Store
    from agent.telemetry import Telemetry
    from agent.transport import Transport

log = logging.getLogger("emoe.agent")


class NodeState:
    """One node. The real process passes nothing and gets a RealClock, GrpcTransport and file Store; the
    in-process simulator injects a FakeClock-driven clock, a SimTransport and an in-memory Store.

    Its parts, built by start() on the recovered head, each complete:
    - `load` (agent.loadpath.LoadPath): shim reports -> this node's windows -> gossip -> cluster windows;
    - `pipeline` (agent.pipeline.DecisionPipeline): closed windows -> controller -> planning turn -> proposals;
    - `reactions` (agent.reactions.MembershipReactions): lost ranks repaired, repaired ranks restored (through
      agent.rejoin), lagging engines named;
    - `view` (agent.adminview.AdminView): what the admin service reads;
    - `manual` (agent.manual.ManualPath): the operator's proposals, drains, restores and pause.
    NodeState itself wires them, serves the shim link (the committed tables out), and owns the lifecycle."""

    pipeline: DecisionPipeline
    load: LoadPath
    reactions: MembershipReactions
    view: AdminView
    manual: ManualPath

    def __init__(self, cfg: AgentConfig, *, clock: Clock | None = None, transport: Transport | None = None,
                 store: Store | None = None, telemetry: Telemetry | None = None, rng_seed: int | None = None,
                 had_store: bool | None = None, drops: Callable[[str], bool] | None = None) -> None:
        """`drops`: the gRPC transport's fault hook (agent.transport.grpc.GrpcTransport; the chaos harness's)."""
        self.cfg = cfg
        self.node_id = cfg.node_id
        c = cfg.cluster
        self.topology = Topology(c.nodes, c.ranks_per_node, c.slots_per_rank)
        self.data_dir = Path(cfg.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        d = cfg.decision
        self.params = DecisionParams(window=d.window, theta=d.theta, budget_windows=d.budget_windows, tau=d.tau,
                                     rollback_windows=d.rollback_windows, max_ops=d.max_ops,
                                     replay_windows=d.replay_windows, expert_bytes=c.expert_bytes, planner=d.planner,
                                     sample_every=d.sample_every,
                                     # the fast path triggers on a big breach; never below the plain threshold
                                     fast_theta=max(d.theta, DecisionParams.fast_theta))
        self._table_waiters: list[asyncio.Future[None]] = []
        self._health = "STARTING"
        self._presence: RankPresence | None = None  # the local link's rank presence, once served (serve_shim)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._voters = list(cfg.consensus.voters) or sorted(cfg.seed_map) or [cfg.node_id]
        self.installs = Installs(self._my_ranks(), cfg.engine.install_lag_s)  # what this node's engines run
        self.gossip: GossipNode | None = None
        self.consensus: CommitBackend | None = None
        self.clock: Clock | None = clock
        self.transport: Transport | None = transport
        self.store: Store | None = store
        self.telemetry: Telemetry | None = telemetry
        self.rng_seed = rng_seed
        # whether this node ran before (then an empty store was lost): from the data_dir's marker unless given
        self.had_store = had_store
        self._drops = drops

    # ---- construction -------------------------------------------------------------------------
    def _my_ranks(self) -> list[int]:
        if self.cfg.ranks:
            return list(self.cfg.ranks)
        ids = sorted(set(self._voters) | {self.node_id})
        idx = ids.index(self.node_id) % self.topology.nodes
        rpn = self.topology.ranks_per_node
        return list(range(idx * rpn, (idx + 1) * rpn))

    def attach(self, server: grpc.aio.Server) -> None:
        from agent.credentials import channel_credentials
        from agent.transport.grpc import GrpcTransport
        if self.transport is None:
            addresses = {n: a for n, a in self.cfg.seed_map.items() if n != self.node_id}
            self.transport = GrpcTransport(self.node_id, addresses, credentials=channel_credentials(self.cfg),
                                           drops=self._drops)
        if not isinstance(self.transport, GrpcTransport):
            raise RuntimeError(f"{self.node_id}: attach() serves gRPC; this node was given {type(self.transport).__name__}")
        self.transport.attach(server)

    def start(self) -> None:
        from agent.clock import RealClock
        from agent.consensus.node import ConsensusNode
        from agent.credentials import vote_signer
        from agent.datadir import LOG_NAME, mark_owner, owner
        from agent.gossip_node import GossipNode
        from agent.store import Store
        from agent.telemetry import Telemetry
        from dataplane_shim.genesis import genesis_table

        telemetry = self.telemetry = self.telemetry or Telemetry.from_env(self.cfg.telemetry.enabled,
                                                                          node_id=self.node_id)
        clock = self.clock = self.clock or RealClock()
        transport = self.transport
        if transport is None:
            raise RuntimeError(f"{self.node_id}: start() before attach(): no transport")
        c = self.cfg.cluster
        store = self.store = self.store or Store(self.data_dir / LOG_NAME)
        marked = self.had_store is None
        had_store = owner(self.data_dir, self.node_id) if marked else bool(self.had_store)
        genesis = genesis_table(c.genesis, self.topology, c.layers, c.experts)  # the engine's boot placement
        voter = Voter(self.params, self.cfg.consensus.verify_tolerance)  # the replay windows: verifies proposals
        signer = vote_signer(self.cfg)  # under mTLS: votes, member claims and load windows are signed with the node key
        if self.cfg.consensus.backend == "etcd":
            # commit by etcd transaction compare(version == v) -> put(v + 1); the same interface as quorum
            from agent.etcd_backend import EtcdBackend

            backend: CommitBackend = EtcdBackend(list(self.cfg.consensus.etcd_endpoints), self.node_id, genesis,
                                                 store=store, verifier=voter.verify)
        else:
            backend = ConsensusNode(self.node_id, self._voters, store, clock, transport, self.cfg.consensus, genesis,
                                    verifier=voter.verify, live_voters=self._live_voters,
                                    members=lambda: self.gossip.live_nodes() if self.gossip is not None else [],
                                    had_store=had_store, signer=signer, enrolment=None if self.rng_seed is None
                                    else zlib.crc32(b"e%d" % self.rng_seed) | 1)  # seeded runs: reproducible
        self.consensus = backend
        backend.on_commit(self._on_commit)
        backend.start()  # recovers the committed log: the controller plans from the recovered head
        self.installs.committed(backend.head.version, clock.now())
        if marked and not had_store:
            mark_owner(self.data_dir, self.node_id)
        self.pipeline = DecisionPipeline(
            self.node_id, self.params, backend, voter, voters=self._voters, live_voters=self._live_voters,
            handover_windows=self.cfg.decision.handover_windows, clock=clock, telemetry=telemetry,
            each_window=lambda: self.reactions.each_window())
        self.manual = ManualPath(self.pipeline, backend, clock)
        rejoin = Rejoin(clock, self._my_ranks(), self.cfg.gossip.rejoin_ms / 1000, self.manual.restore_now)
        rejoin.recovered(backend.commits_since(0), backend.head)
        self.gossip = GossipNode(self.node_id, self.cfg.advertise_address, self._my_ranks(), self.cfg.gossip, clock,
                                 transport, {n: a for n, a in self.cfg.seed_map.items() if n != self.node_id},
                                 rng_seed=self.rng_seed if self.rng_seed is not None else zlib.crc32(self.node_id.encode()),
                                 signer=signer)
        self.load = LoadPath(self.node_id, self.topology, c.layers, c.experts, self.params.window, self.gossip,
                             self.pipeline.close_window,
                             lambda rank, version: self.installs.reported(rank, version, clock.now()),
                             lambda: backend.abstains, sample_every=self.params.sample_every)
        self.gossip.on_window(self.load.on_window)
        self.reactions = MembershipReactions(
            self.node_id, self._my_ranks(), clock, backend, self.pipeline, self.gossip, self.installs, rejoin,
            lambda: self._health == "SERVING" and not backend.abstains
            and 2 * len(self._live_voters()) > len(self._voters))
        self.gossip.on_member_change(self.reactions.member_changed)
        self.view = AdminView(self.node_id, self.topology, backend, self.gossip, self.pipeline, self.load, self.installs,
                              clock,
                              lambda: self._health, lambda: self.reactions.presence)
        self.gossip.start()
        self._health = "SERVING"

    def stop(self, graceful: bool = True) -> None:
        """Leave the cluster (graceful: peers learn at once instead of by suspicion) and stop the protocols."""
        self._health = "NOT_SERVING"
        if self._presence is not None:
            self._presence.close()
        if self.gossip is not None:
            if graceful:
                self.gossip.leave()
            self.gossip.stop()
        if self.consensus is not None:
            self.consensus.stop()

    async def close(self) -> None:
        if self.consensus is not None:
            await self.consensus.close()
        if self.transport is not None:
            await self.transport.close()
        if self.telemetry is not None:
            self.telemetry.shutdown()

    async def serve_shim(self, path: str) -> grpc.aio.Server:
        """The local link for this node's engine ranks (after start()): a rank whose process leaves (its link
        closes) is lost first-hand, in milliseconds, and restored when it attaches again (agent.reactions)."""
        from agent.shim_link import serve_unix

        self._presence = self.reactions.serve_presence()
        return await serve_unix(path, self, self.load.on_report, presence=self._presence)

    # ---- shim link: TableSource + load sink ---------------------------------------------------
    def head_version(self) -> int:
        return int(self._backend.head.version)

    def commits_since(self, version: int) -> list[cpb.Commit]:
        return list(self._backend.commits_since(version))

    async def wait_for_newer(self, version: int) -> None:
        while self.head_version() <= version:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._table_waiters.append(fut)
            await fut

    # ---- load view -> controller -> consensus --------------------------------------------------
    def _live_voters(self) -> list[str]:
        """The voters that are live and, by their newest window, neither learners nor on a failed store: the
        planning turn passes over the others, and a round-0 owner among them is not waited for (a learner's
        proposals are refused, so a turn it held passed only after handover_windows)."""
        live = set(self.gossip.live_nodes()) if self.gossip is not None else set()
        live.add(self.node_id)
        live -= self.gossip.learners() if self.gossip is not None else set()
        return sorted(v for v in self._voters if v in live)

    def _on_commit(self, commit: cpb.Commit, table: RoutingTable) -> None:
        self.pipeline.on_commit(commit, table, self.load.newest_reported())
        self.reactions.committed(commit, table)
        waiters, self._table_waiters = self._table_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    # ---- admin backend ------------------------------------------------------------------------
    @property
    def _backend(self) -> CommitBackend:
        if self.consensus is None:
            raise RuntimeError(f"{self.node_id}: the agent has not started (no commit backend yet)")
        return self.consensus

    @property
    def _gossip(self) -> GossipNode:
        if self.gossip is None:
            raise RuntimeError(f"{self.node_id}: the agent has not started (no gossip yet)")
        return self.gossip

    def head(self) -> RoutingTable:
        return self._backend.head
