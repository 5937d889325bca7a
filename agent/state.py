"""NodeState: one node's live state and the glue between its parts.

Load path: shim reports -> LoadPath (LocalWindows -> gossip -> ClusterWindows) -> DecisionPipeline.close_window.
Decision path: DecisionPipeline (agent.decision.pipeline: controller, planning turn, Ready loop) -> (the window's planner
only) the commit backend's propose -> commit.
Commit path: backend.on_commit -> DecisionPipeline.on_commit (controller: TableCommitted) -> MembershipReactions
(rejoin, installs) -> shims (WatchTables stream).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from agent.admin.adminview import AdminView
from agent.commit import CommitBackend, PauseSwitch
from agent.config import AgentConfig, ClusterConfig, ConfigError, load
from agent.decision.manual import ManualPath
from agent.decision.offloop import OffLoopPlanner
from agent.decision.pipeline import DecisionPipeline, PlanRunner, plan_here
from agent.decision.reactions import MembershipReactions
from agent.decision.rejoin import Rejoin
from agent.decision.voter import Voter
from agent.fingerprint import FingerprintCheck, fingerprint
from agent.link.installs import Installs
from agent.link.loadpath import LoadPath
from agent.link.reportguard import ReportGuard
from controlplane.controller import DecisionParams
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as cpb

if TYPE_CHECKING:
    from agent.admin.telemetry import Telemetry
    from agent.clock import Clock
    from agent.gossip.gossip_node import GossipNode
    from agent.link.ranklink import RankPresence
    from agent.storage.store import Store
    from agent.transport import Transport

log = logging.getLogger(__name__)


def _no_time_of_day() -> int:
    """The wall clock in ms where none is known: always 0."""
    return 0


def _epoch_ms(wall: Callable[[], float] | None) -> Callable[[], int]:
    """`wall` (seconds since the epoch) in whole ms; none: always 0 (no time of day known)."""
    if wall is None:
        return _no_time_of_day
    clock = wall

    def epoch_ms() -> int:
        return int(clock() * 1000)

    return epoch_ms


def _by_number(node_id: str) -> list[tuple[int, int | str]]:
    """A sort key that orders the numbers in an id by value: node2 before node10."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", node_id) if part]


def voters_of(cfg: AgentConfig) -> list[str]:
    """The voters: consensus.voters, else every seed, else this node alone."""
    return list(cfg.consensus.voters) or sorted(cfg.seed_map) or [cfg.node_id]


def rank_place(cfg: AgentConfig) -> tuple[list[str], int]:
    """The node ids sorted as strings (voters and this node), and this node's place among them modulo the
    cluster's nodes: with `ranks` unset, the node owns ranks_per_node consecutive ranks from that place."""
    ids = sorted(set(voters_of(cfg)) | {cfg.node_id})
    return ids, ids.index(cfg.node_id) % cfg.cluster.nodes


def rank_order_warning(cfg: AgentConfig) -> str:
    """With `ranks` empty, a node owns the ranks of its place among the node ids sorted as strings
    (NodeState._my_ranks). Where the ids carry numbers of different lengths (node2, node10) that place is not
    their number's: node10 sorts second, and owns the ranks node2's engine most likely runs. Returns a warning
    naming both when this node's place differs by number (empty otherwise, and with `ranks` set)."""
    if cfg.ranks:
        return ""
    node_id, ranks_per_node = cfg.node_id, cfg.cluster.ranks_per_node
    ids, at = rank_place(cfg)
    there = sorted(ids, key=_by_number).index(node_id) % cfg.cluster.nodes
    if at == there:
        return ""
    return (f"{node_id} owns ranks {at * ranks_per_node}-{(at + 1) * ranks_per_node - 1}: with `ranks` unset a "
            f"node owns the ranks of its place among the node ids sorted as strings ({', '.join(ids[:4])}"
            f"{', ...' if len(ids) > 4 else ''}), and {node_id} is number {at + 1} there but number {there + 1} "
            f"by the number in its id (ranks {there * ranks_per_node}-{(there + 1) * ranks_per_node - 1}); set "
            "`ranks` in each node's config to the global ranks of its engine, or name the nodes so that both "
            "orders agree (node01, node02, ..., node10)")


def genesis_of(c: ClusterConfig) -> RoutingTable:
    """The agents' version 1, the placement the engine boots with: `cluster.genesis` built by the engine side's
    dataplane_shim.genesis.genesis_table. Raises ConfigError naming cluster.genesis where it cannot be built (an
    unknown name, a missing or misshapen placement file)."""
    from dataplane_shim.errors import ShimError
    from dataplane_shim.genesis import genesis_table

    try:
        return genesis_table(c.genesis, Topology(c.nodes, c.ranks_per_node, c.slots_per_rank), c.layers, c.experts)
    except ShimError as e:
        raise ConfigError(f"cluster.genesis = {c.genesis!r}: expected {e}") from None


def load_checked(path: str | Path) -> AgentConfig:
    """agent.config.load, then the genesis the engine side builds from it (genesis_of): what every command that
    reads an agent's config calls, so that a config is valid or invalid the same way for all of them (the
    genesis check left agent.config so that the consensus core reaches nothing of the engine side)."""
    cfg = load(path)
    try:
        genesis_of(cfg.cluster)
    except ConfigError as e:
        raise ConfigError(f"{Path(path)}: {e}") from None
    return cfg


def decision_params(cfg: AgentConfig) -> DecisionParams:
    """The decision core's knobs from an agent's config (its `decision` section and the cluster's expert bytes)."""
    d = cfg.decision
    return DecisionParams(window=d.window, theta=d.theta, budget_windows=d.budget_windows, tau=d.tau,
                          rollback_windows=d.rollback_windows, max_ops=d.max_ops,
                          replay_windows=d.replay_windows, expert_bytes=cfg.cluster.expert_bytes, planner=d.planner,
                          sample_every=d.sample_every, load_ms=DecisionParams.load_ms if d.load_ms is None else d.load_ms,
                          load_ms_override=d.load_ms is not None, copy_cost_measured=d.copy_cost_measured,
                          horizon_windows=d.horizon_windows, worth_margin=d.worth_margin,
                          polish_theta=d.polish_theta, polish_lam=d.polish_lam,
                          # the fast path triggers on a big breach; never below the plain threshold
                          fast_theta=max(d.theta, d.fast_theta))


class NodeState:
    """One node, built complete: constructing it recovers the store, builds every part on the recovered head
    and starts the protocols; the object returned serves until stop() (then close()). The real process
    (agent.process.AgentProcess) passes its gRPC transport and gets a RealClock and a file Store; the in-process
    simulator (chaos.simcluster) injects a FakeClock-driven clock, a SimTransport and an in-memory Store.

    Its parts, each complete, none optional:
    - `gossip` (agent.gossip.gossip_node.GossipNode): membership and the load windows' dissemination;
    - `consensus` (agent.commit.CommitBackend): the quorum node (agent.consensus.node) or etcd;
    - `load` (agent.link.loadpath.LoadPath): shim reports -> this node's windows -> gossip -> cluster windows;
    - `pipeline` (agent.decision.pipeline.DecisionPipeline): closed windows -> controller -> planning turn -> proposals;
    - `reactions` (agent.decision.reactions.MembershipReactions): absent nodes' ranks not taken for idle ones (the load
      path's cluster windows name them missing), ranks the engines lost repaired, repaired ranks restored
      (through agent.decision.rejoin), lagging engines named;
    - `view` (agent.admin.adminview.AdminView): what the admin service reads;
    - `manual` (agent.decision.manual.ManualPath): the operator's proposals, drains, restores and pause;
    - `pause` (agent.commit.PauseSwitch): the cluster's pause switch, committed apart from the tables (the quorum's
      control records, or etcd's key); the pipeline plans no rebalance while it says paused;
    - `fingerprint` (agent.fingerprint.FingerprintCheck): this node's cluster fingerprint against its members'; on
      a mismatch with a quorum of the voters the backend neither votes nor proposes.
    NodeState itself wires them, serves the shim link (the committed tables out), and owns the lifecycle."""

    def __init__(self, cfg: AgentConfig, transport: Transport, *, clock: Clock | None = None,
                 store: Store | None = None, telemetry: Telemetry | None = None, rng_seed: int | None = None,
                 had_store: bool | None = None, wall: Callable[[], float] | None = None) -> None:
        """`had_store`: whether this node ran before, so that an empty store means a lost one (default: the
        data_dir's marker). `wall`: the time of day (seconds since the epoch) each proposed plan carries for
        the operator (`emoe history`); default: the system's with the real clock, none (0) with an injected
        clock, so that a simulated cluster stays reproducible from its seed. Likewise, with the real clock the
        node computes its plans on a worker thread (agent.decision.offloop), with an injected one at once. Raises
        agent.storage.store.StoreCorrupt, StoreNewer or agent.storage.datadir.DataDirError when the store cannot be recovered,
        ConfigError when cluster.genesis cannot be built (genesis_of)."""
        from agent.admin.telemetry import Telemetry
        from agent.clock import RealClock
        from agent.consensus.node import ConsensusNode
        from agent.credentials import vote_signer
        from agent.gossip.gossip_node import GossipNode
        from agent.storage.datadir import FINGERPRINT_NAME, LOG_NAME, mark_owner, owner
        from agent.storage.store import Store

        self.cfg = cfg
        self.node_id = cfg.node_id
        c = cfg.cluster
        self.topology = Topology(c.nodes, c.ranks_per_node, c.slots_per_rank)
        self.data_dir = Path(cfg.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.params = decision_params(cfg)
        self._table_waiters: list[asyncio.Future[None]] = []
        self._health = "STARTING"
        self._presence: RankPresence | None = None  # the local link's rank presence, once served (serve_shim)
        self._voters = voters_of(cfg)
        ranks = self._my_ranks()
        self.installs = Installs(ranks, cfg.engine.install_lag_s)  # what this node's engines run
        self.transport: Transport = transport
        self.telemetry: Telemetry = telemetry or Telemetry.from_env(cfg.telemetry.enabled, node_id=self.node_id)
        if wall is None and clock is None:
            wall = time.time
        self.planner_thread = OffLoopPlanner(self.node_id) if clock is None else None
        run_plan: PlanRunner = self.planner_thread if self.planner_thread is not None else plan_here
        self.clock: Clock = clock or RealClock()
        self.store: Store = store or Store(self.data_dir / LOG_NAME)
        marked = had_store is None
        ran_before = owner(self.data_dir, self.node_id) if marked else bool(had_store)
        signer = vote_signer(cfg)  # under mTLS: votes, member claims and load windows are signed with the node key
        genesis = genesis_of(c)  # the engine's boot placement
        mine = fingerprint(c, genesis)  # what every agent of the cluster must agree on, in this node's member state
        self.gossip: GossipNode = GossipNode(
            self.node_id, cfg.advertise_address, ranks, cfg.gossip, self.clock, transport,
            {n: a for n, a in cfg.seed_map.items() if n != self.node_id},
            rng_seed=rng_seed if rng_seed is not None else zlib.crc32(self.node_id.encode()), signer=signer,
            fingerprint=mine)
        # the cluster's fingerprint, as a quorum of the voters last held it, kept in the data_dir (an injected
        # store, the simulator's, shares one data_dir among its nodes: kept in memory there)
        self.fingerprint = FingerprintCheck(self.node_id, mine, self._voters, self.gossip.fingerprints,
                                            keep=self.data_dir / FINGERPRINT_NAME if marked else None)

        # the commit backend, recovered: the controller plans from the recovered head
        voter = Voter(self.params, cfg.consensus.verify_tolerance)  # the replay windows: verifies proposals
        self.consensus: CommitBackend
        self.pause: PauseSwitch
        if cfg.consensus.backend == "etcd":
            # commit by etcd transaction compare(version == v) -> put(v + 1); the same interface as quorum
            from agent.etcd.etcd_backend import EtcdBackend
            from agent.etcd.etcd_pause import EtcdPause

            etcd = EtcdBackend(list(cfg.consensus.etcd_endpoints), self.node_id, genesis, store=self.store,
                               verifier=voter.verify, gate=self.fingerprint.verdict)
            etcd.start()
            switch = EtcdPause(etcd.connected_client, etcd.control_key(), self.node_id, self.store)
            switch.start()  # (the quorum's control records start with their consensus node)
            self.consensus, self.pause = etcd, switch
        else:
            quorum = ConsensusNode(
                self.node_id, self._voters, self.store, self.clock, transport, cfg.consensus, genesis,
                verifier=voter.verify, live_voters=self._live_voters, members=self.gossip.live_nodes,
                had_store=ran_before, signer=signer, gate=self.fingerprint.verdict,
                signs_control=getattr(transport, "signs_control", None),
                is_member=self._is_member,
                enrolment=None if rng_seed is None else zlib.crc32(b"e%d" % rng_seed) | 1)  # seeded: reproducible
            quorum.start()
            self.consensus, self.pause = quorum, quorum.control
        backend = self.consensus
        self.installs.committed(backend.head.version, self.clock.now())
        if marked and not ran_before:
            mark_owner(self.data_dir, self.node_id)

        # the parts over the recovered head
        self.pipeline = DecisionPipeline(
            self.node_id, self.params, backend, voter, voters=self._voters, live_voters=self._live_voters,
            handover_windows=cfg.decision.handover_windows, clock=self.clock, telemetry=self.telemetry,
            each_window=self._each_window,
            wall_ms=_epoch_ms(wall), run_plan=run_plan)
        self.pipeline.paused = self._paused(self.pause.record)  # the switch as recovered
        self.manual = ManualPath(self.pipeline, backend, self.pause, self.clock)
        rejoin = Rejoin(self.clock, ranks, cfg.gossip.rejoin_ms / 1000, self.manual.restore_now)
        rejoin.recovered(backend.commits_since(0), backend.head)
        guard = ReportGuard(ranks, self.topology.ranks, c.top_k, cfg.engine.max_batch_tokens,
                            self.head_version)  # what this node's engines can say
        self.load = LoadPath(self.node_id, self.topology, c.layers, c.experts, self.params.window, self.gossip,
                             self.pipeline.close_window,
                             self._engine_ran, self._abstains, guard, sample_every=self.params.sample_every,
                             engine_failed=self.installs.failed, absent=self._absent, unreachable=self._unreachable)
        self.pipeline.timing = self.load.cluster.timing  # the engines' measured step times, per window
        self.reactions = MembershipReactions(
            self.node_id, ranks, self.clock, backend, self.pipeline, self.gossip, self.installs, rejoin,
            self._may_restore, hold_s=cfg.gossip.dead_reclaim_ms / 1000)
        self.view = AdminView(self.node_id, self.topology, backend, self.gossip, self.pipeline, self.load,
                              self.installs, self.clock, self._lifecycle, self._rank_presence,
                              self.pause, self.fingerprint, genesis)

        # wired, then started
        backend.on_commit(self._on_commit)
        self.pause.on_change(self._switched)
        self.gossip.on_window(self.load.on_window)
        self.gossip.on_member_change(self.reactions.member_changed)
        self.gossip.start()
        self._health = "SERVING"

    # ---- what the parts ask NodeState (named, so that a load report's trip can be followed) --------------------
    def _is_member(self, node_id: str) -> bool:
        """Whether gossip knows `node_id`, in any state, until it is reaped (the consensus node's enrolment)."""
        return self.gossip.member(node_id) is not None

    def _each_window(self) -> None:
        """A window closed in the pipeline: the membership reactions' duties of each window."""
        self.reactions.each_window()

    def _engine_ran(self, rank: int, version: int) -> None:
        """A load report says `rank` runs `version`: the installs note it, now."""
        self.installs.reported(rank, version, self.clock.now())

    def _abstains(self) -> str:
        """Why the commit backend neither votes nor proposes now ("" while it may): the load path says so."""
        return self.consensus.abstains

    def _absent(self, contributors: Sequence[str]) -> tuple[str, ...]:
        """The nodes holding active ranks whose load no window of `contributors` carries (the membership
        reactions judge): a closed window names them missing."""
        return self.reactions.absent(contributors)

    def _unreachable(self, ranks: tuple[int, ...]) -> None:
        """This node's engines could not reach `ranks`: the membership reactions hold the evidence."""
        self.reactions.unreachable(ranks)

    def _may_restore(self) -> bool:
        """Whether this node may propose a restore now: serving, not abstaining from consensus, and a quorum of
        the voters live."""
        return (self._health == "SERVING" and not self.consensus.abstains
                and 2 * len(self._live_voters()) > len(self._voters))

    def _lifecycle(self) -> str:
        """STARTING, SERVING or NOT_SERVING: what the admin view says of this node."""
        return self._health

    def _rank_presence(self) -> RankPresence | None:
        """This node's engine ranks on the local link, once served (None before)."""
        return self.reactions.presence

    @staticmethod
    def _paused(c: cpb.ControlCommit | None) -> bool:
        """Whether the switch says automatic rebalancing is paused (never written: not)."""
        return c is not None and c.record.paused

    def _switched(self, c: cpb.ControlCommit) -> None:
        """A newer pause record: the pipeline plans no rebalance while it says paused."""
        self.pipeline.paused = self._paused(c)

    def _my_ranks(self) -> list[int]:
        if self.cfg.ranks:
            return list(self.cfg.ranks)
        idx = rank_place(self.cfg)[1]
        rpn = self.topology.ranks_per_node
        return list(range(idx * rpn, (idx + 1) * rpn))

    # ---- lifecycle ------------------------------------------------------------------------------
    def stop(self, graceful: bool = True) -> None:
        """Leave the cluster (graceful: peers learn at once instead of by suspicion) and stop the protocols."""
        self._health = "NOT_SERVING"
        if self._presence is not None:
            self._presence.close()
        if graceful:
            self.gossip.leave()
        self.gossip.stop()
        self.pause.stop()
        self.consensus.stop()
        if self.planner_thread is not None:
            self.planner_thread.close()

    async def close(self) -> None:
        await self.consensus.close()
        await self.transport.close()
        self.telemetry.shutdown()

    async def serve_shim(self, path: str) -> grpc.aio.Server:
        """The local link for this node's engine ranks (once built): a rank whose process leaves (its link
        closes) is lost first-hand, in milliseconds, and restored when it attaches again (agent.decision.reactions).
        The socket is group-writable, in the data_dir's group: engines of that group may connect."""
        from agent.link.shim_link import serve_unix

        self._presence = self.reactions.serve_presence()
        return await serve_unix(path, self, self.load.on_report, presence=self._presence,
                                group=self.data_dir.stat().st_gid)

    # ---- shim link: TableSource + load sink ---------------------------------------------------
    def head_version(self) -> int:
        return int(self.consensus.head.version)

    def commits_since(self, version: int) -> list[cpb.Commit]:
        return list(self.consensus.commits_since(version))

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
        live = set(self.gossip.live_nodes()) | {self.node_id}
        live -= self.gossip.learners()
        return sorted(v for v in self._voters if v in live)

    def _on_commit(self, commit: cpb.Commit, table: RoutingTable) -> None:
        self.pipeline.on_commit(commit, table, self.load.newest_reported())
        self.reactions.committed(commit, table)
        waiters, self._table_waiters = self._table_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def head(self) -> RoutingTable:
        return self.consensus.head
