"""The Recovery part of ConsensusNode: rebuilding after store loss (agent.consensus.rebuild), snapshot catch-up
from a peer that compacted the versions this node lacks, and fail-stop while the store cannot be written.

Its own state: `rebuild` (set while a node with an empty or cut store may not vote yet), this start's
`enrolment`, and the proposals `deferred` while a new node still asks whether it may vote. The node gives it
its fixed collaborators at construction and answers the rest through `RecoveryNode`. Every durable write of
the acceptor's state goes through `persist` here, so a failed one stops this node from voting (fail-stop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from google.protobuf.message import Message

from agent.clock import Clock
from agent.config import ConsensusConfig
from agent.consensus.core import Outcome, Timers
from agent.consensus.paxos import Acceptor, BallotAttempt
from agent.consensus.rebuild import Rebuild
from agent.consensus.refusal import Refusal
from agent.storage.store import Recovered, Store, StoreFailed
from agent.transport import Transport
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as pb

if TYPE_CHECKING:
    from agent.consensus.controlnode import ControlNode
    from agent.consensus.log import CommittedLog

log = logging.getLogger(__name__)


class RecoveryNode(Protocol):
    """What recovery asks of its node (ConsensusNode). `gate` is read at every use: callers may replace it."""

    running: bool
    acceptor: Acceptor
    log: CommittedLog
    control: ControlNode
    gate: Callable[[], str]

    def learned(self, c: pb.Commit, src: str | None, broadcast: bool,
                attempt: BallotAttempt | None = None) -> tuple[Refusal, str]:
        """Learn a commit (validate, persist, install)."""

    def catch_up(self, peer: str) -> None:
        """Fetch and install the commits `peer` has beyond our head."""

    def propose(self, table: RoutingTable, plan: pb.Plan, on_done: Callable[[Outcome], None]) -> None:
        """Propose `table` as the next version (a deferred proposal, once this node may vote)."""


class Recovery:
    """ConsensusNode's recovery part (see the module docstring): the node asks it whether this node may vote
    (`cannot_vote`), and writes the acceptor's state through `persist`."""

    def __init__(self, node: RecoveryNode, *, node_id: str, voters: list[str], cfg: ConsensusConfig, clock: Clock,
                 transport: Transport, store: Store, timers: Timers, timeout: float, enrolment: int,
                 peer_heads: dict[str, int]) -> None:
        self.node = node
        self.node_id, self.voters, self.cfg = node_id, voters, cfg
        self.clock, self.transport, self.store, self.timers = clock, transport, store, timers
        self.timeout = timeout
        self.peer_heads = peer_heads  # the node's: where to catch up from once the disk works again
        # this start's enrolment id, should it rebuild (agent/consensus/rebuild.py): fresh at every start
        self.enrolment = enrolment
        self.rebuild: Rebuild | None = None  # set while a node with an empty store may not vote yet
        # proposals made before a new node heard whether it may vote (right after start): run once it knows
        self.deferred: list[tuple[float, RoutingTable, pb.Plan, Callable[[Outcome], None]]] = []

    # ---- rebuild after store loss (agent.consensus.rebuild) ----------------------------------------
    def start(self, rec: Recovered, had_store: bool) -> None:
        """At start, from what the store recovered: rebuild from the other voters as a learner when this node's
        votes may be forgotten (an empty store, a cut log, a rebuild not done), or when it must ask first."""
        cut = rec.lost_bytes > 0  # the log was cut at a record boundary: votes it gave may be forgotten
        mark = rec.rebuild  # this store's own rebuild; one not done is resumed as it was (it has not voted since)
        resumed = mark is not None and not mark.done and not cut
        if (rec.records == 0 or cut or resumed) and self.node_id in self.voters and len(self.voters) > 1:
            if resumed and mark is not None:  # (the data_dir's marker is newer than the mark, so not had_store)
                self.enrolment = int(mark.enrolment)
                why = "restarted during a strict rebuild" if mark.strict else ""
            else:
                why = (f"lost the last {rec.lost_bytes} bytes of its log" if cut
                       else "store is empty but this node ran before" if had_store
                       else "initial_cluster_state = 'existing'" if self.cfg.initial_cluster_state == "existing"
                       else "")
            self.rebuild = Rebuild(self.node_id, self.voters, self.node.log.head.version, why)
            try:  # before any request: a start that finds this mark unfinished resumes it as it was
                self.store.save_rebuild(pb.RebuildMark(enrolment=self.enrolment, strict=bool(why)))
            except StoreFailed:
                self.store_failed()
            if why:
                log.warning("%s: %s: rebuilding from the other voters as a learner", self.node_id, why)

    def deciding(self) -> bool:
        """Just started with an empty store and still asking whether it may vote (it knows within a round trip):
        a proposal made now waits in `deferred`."""
        rb = self.rebuild
        return rb is not None and not rb.decided and not self.store.failed

    @property
    def role(self) -> str:
        if self.node_id not in self.voters:
            return "non-voter"
        self.cannot_vote()  # a learner that has caught up becomes a voter here too
        return "voter" if self.rebuild is None else self.rebuild.describe(self.node.log.head.version)

    @property
    def abstains(self) -> str:
        """Why this node may neither vote nor propose now (agent.commit.CommitBackend.abstains): a learner, or a
        failed store or history, or a gate (a drifted config); "" while it may, and while a founding member still
        asks whether it ran before."""
        rb = self.rebuild
        if self.node_id not in self.voters or (rb is not None and not rb.decided and not rb.strict
                                               and not self.store.failed and not self.node.log.conflicts):
            return self.node.gate()
        return self.cannot_vote()

    def cannot_vote(self) -> str:
        """Why this node may not vote now ("" when it may)."""
        if self.store.failed or self.node.log.conflicts:
            return f"{self.node_id}'s {self.failure}"
        gated = self.node.gate()
        if gated:
            return gated
        rb = self.rebuild
        if rb is not None:
            if not rb.may_vote(self.node.log.head.version):
                return f"{self.node_id} is a {rb.describe(self.node.log.head.version)}"
            try:  # durable before the first vote: a later start trusts this store again
                self.store.save_rebuild(pb.RebuildMark(enrolment=self.enrolment, strict=rb.strict, done=True))
            except StoreFailed:
                self.store_failed()
                return f"{self.node_id}'s {self.failure}"
            if rb.strict:
                log.warning("%s: rebuilt (head %d): voting again", self.node_id, self.node.log.head.version)
            self.rebuild = None
            self.store.settle_loss()  # a cut log found at start is settled: the next start trusts it again
        return ""

    def ask_rebuild(self) -> None:
        rb = self.rebuild
        if rb is None or not self.node.running:
            return
        if rb.decided:
            self._rebuild_decided()
            return
        deferred, self.deferred = self.deferred, []  # proposals made at start wait at most this long
        for t0, table, plan, on_done in deferred:
            if self.clock.now() - t0 < 4 * self.timeout:
                self.deferred.append((t0, table, plan, on_done))
            else:
                on_done(Outcome(False, table.version, f"UNAVAILABLE: {self.cannot_vote()}"))
        rb.early.clear()
        for dst in rb.others:
            self._ask_rebuild_one(dst)
        self.timers.arm("rebuild", 0, self.timeout, self.ask_rebuild)

    def _ask_rebuild_one(self, dst: str) -> None:
        req = pb.CatchUpRequest(from_version=self.node.log.head.version, from_node=self.node_id,
                                limit=self.cfg.catchup_batch, enrolment=self.enrolment)
        self.transport.call(dst, "Consensus/CatchUp", req, self.timeout, partial(self._on_rebuild_reply, dst))

    def peer_is_up(self, peer: str) -> None:
        """A voter just called us: while deciding, ask it now rather than at the next retry (the members of a new
        cluster start one after another, and each decides once enough of the others answered)."""
        rb = self.rebuild
        if rb is not None and not rb.decided and peer in rb.others and not rb.answered(peer) and peer not in rb.early:
            rb.early.add(peer)  # once per round: two deciding nodes would otherwise ask each other without end
            self._ask_rebuild_one(peer)

    def _on_rebuild_reply(self, peer: str, r: Message | None) -> None:
        rb = self.rebuild
        if rb is None or not self.node.running or not isinstance(r, pb.CatchUpReply):
            return
        rb.report(peer, int(r.committed_head), int(r.acceptor_high), bool(r.rebuilding), bool(r.knew_you))
        if r.HasField("control"):
            self.node.control.learn(r.control)
        if not self.snapshot(peer, r):  # (a snapshot asks the peer for the rest itself)
            self.learn_in_order(r.commits)
            if r.committed_head > self.node.log.head.version:
                self.node.catch_up(peer)
        if rb.decided:
            self.timers.disarm("rebuild", 0)
            self._rebuild_decided()

    def enrol(self, peer: str, enrolment: int) -> bool | None:
        """Record a voter's enrolment (CatchUpRequest.enrolment) durably, before the reply leaves. Returns
        whether it has enrolled here under another id (it ran before: Store.enrol), or None when the record
        cannot be made durable (then the request is not answered: an unrecorded answer would break rebuild's
        argument)."""
        if not enrolment or peer not in self.voters or peer == self.node_id:
            return False
        try:
            return self.store.enrol(peer, enrolment)
        except StoreFailed:
            self.store_failed()
            return None

    def learn_in_order(self, commits: Iterable[pb.Commit]) -> None:
        """Learn a reply's commits from the one after our head on, stopping at the first that is refused."""
        for c in commits:
            if c.table.version == self.node.log.head.version + 1 and self.node.learned(c, None, broadcast=False)[1]:
                break

    def snapshot(self, peer: str, r: pb.CatchUpReply) -> bool:
        """Install the head a peer sent because it compacted the versions we lack. True if one was installed."""
        if not (r.snapshot and len(r.commits) == 1 and r.commits[0].table.version > self.node.log.head.version + 1):
            return False
        v = int(r.commits[0].table.version)
        try:
            why = self.node.log.install_snapshot(r.commits[0], self.node.acceptor.states_above(v))
        except StoreFailed:
            self.store_failed()
            return False
        if why:
            log.warning("%s: snapshot of version %d from %s refused: %s", self.node_id, v, peer, why)
            return False
        if r.committed_head > self.node.log.head.version:
            self.node.catch_up(peer)
        return True

    def _rebuild_decided(self) -> None:
        self.cannot_vote()
        deferred, self.deferred = self.deferred, []
        for _, table, plan, on_done in deferred:
            self.node.propose(table, plan, on_done)

    # ---- fail-stop on a store that cannot be written ---------------------------------------------
    @property
    def failure(self) -> str:
        """Why this node neither votes nor proposes now ("" while its store works and its history agrees with
        every certified table it has seen)."""
        if self.node.log.conflicts:
            return f"conflicting history: {self.node.log.conflicts[0]}"
        return self.store.failure

    def persist(self, st: pb.AcceptorState) -> bool:
        """Make acceptor state durable; False (and fail-stop until the disk recovers) when it cannot be."""
        try:
            self.store.save_acceptor(st)
        except StoreFailed:
            self.store_failed()
            return False
        return True

    def store_failed(self) -> None:
        """Stop voting and proposing (every handler checks `store.failed`) and try the disk again every
        `disk_retry_ms`; catch-up fetches whatever was committed meanwhile once it works again."""
        if ("disk", 0) in self.timers.armed:
            return

        def retry() -> None:
            if self.store.resume():
                for peer in sorted(self.peer_heads, key=lambda n: -self.peer_heads[n]):
                    if peer != self.node_id:
                        self.node.catch_up(peer)
                        break
            else:
                self.timers.arm("disk", 0, self.cfg.disk_retry_ms / 1000.0, retry)

        self.timers.arm("disk", 0, self.cfg.disk_retry_ms / 1000.0, retry)
