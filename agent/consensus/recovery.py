"""ConsensusNode's recovery paths: rebuilding after store loss (agent.consensus.rebuild), snapshot catch-up
from a peer that compacted the versions this node lacks, and fail-stop while the store cannot be written."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial

from google.protobuf.message import Message

from agent.consensus.core import NodeCore, Outcome
from agent.consensus.rebuild import Rebuild
from agent.consensus.signing import VoteSigner
from agent.storage.store import StoreFailed
from controlplane.table import RoutingTable
from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)


class RecoveryMixin(NodeCore):
    """The recovery state below; ConsensusNode sets it. Calls the other parts only through NodeCore."""

    signer: VoteSigner | None
    gate: Callable[[], str]
    rebuild: Rebuild | None
    enrolment: int
    _deferred: list[tuple[float, RoutingTable, pb.Plan, Callable[[Outcome], None]]]

    # ---- rebuild after store loss (agent.consensus.rebuild) ----------------------------------------
    @property
    def role(self) -> str:
        if self.node_id not in self.voters:
            return "non-voter"
        self._abstains()  # a learner that has caught up becomes a voter here too
        return "voter" if self.rebuild is None else self.rebuild.describe(self.log.head.version)

    @property
    def abstains(self) -> str:
        """Why this node may neither vote nor propose now (agent.commit.CommitBackend.abstains): a learner, or a
        failed store or history, or a gate (a drifted config); "" while it may, and while a founding member still
        asks whether it ran before."""
        rb = self.rebuild
        if self.node_id not in self.voters or (rb is not None and not rb.decided and not rb.strict
                                               and not self.store.failed and not self.log.conflicts):
            return self.gate()
        return self._abstains()

    def _abstains(self) -> str:
        """Why this node may not vote now ("" when it may)."""
        if self.store.failed or self.log.conflicts:
            return f"{self.node_id}'s {self.failure}"
        gated = self.gate()
        if gated:
            return gated
        rb = self.rebuild
        if rb is not None:
            if not rb.may_vote(self.log.head.version):
                return f"{self.node_id} is a {rb.describe(self.log.head.version)}"
            try:  # durable before the first vote: a later start trusts this store again
                self.store.save_rebuild(pb.RebuildMark(enrolment=self.enrolment, strict=rb.strict, done=True))
            except StoreFailed:
                self._store_failed()
                return f"{self.node_id}'s {self.failure}"
            if rb.strict:
                log.warning("%s: rebuilt (head %d): voting again", self.node_id, self.log.head.version)
            self.rebuild = None
            self.store.settle_loss()  # a cut log found at start is settled: the next start trusts it again
        return ""

    def _ask_rebuild(self) -> None:
        rb = self.rebuild
        if rb is None or not self.running:
            return
        if rb.decided:
            self._rebuild_decided()
            return
        deferred, self._deferred = self._deferred, []  # proposals made at start wait at most this long
        for t0, table, plan, on_done in deferred:
            if self.clock.now() - t0 < 4 * self.timeout:
                self._deferred.append((t0, table, plan, on_done))
            else:
                on_done(Outcome(False, table.version, f"UNAVAILABLE: {self._abstains()}"))
        rb.early.clear()
        for dst in rb.others:
            self._ask_rebuild_one(dst)
        self._arm("rebuild", 0, self.timeout, self._ask_rebuild)

    def _ask_rebuild_one(self, dst: str) -> None:
        req = pb.CatchUpRequest(from_version=self.log.head.version, from_node=self.node_id,
                                limit=self.cfg.catchup_batch, enrolment=self.enrolment)
        self.transport.call(dst, "Consensus/CatchUp", req, self.timeout, partial(self._on_rebuild_reply, dst))

    def _peer_is_up(self, peer: str) -> None:
        """A voter just called us: while deciding, ask it now rather than at the next retry (the members of a new
        cluster start one after another, and each decides once enough of the others answered)."""
        rb = self.rebuild
        if rb is not None and not rb.decided and peer in rb.others and not rb.answered(peer) and peer not in rb.early:
            rb.early.add(peer)  # once per round: two deciding nodes would otherwise ask each other without end
            self._ask_rebuild_one(peer)

    def _on_rebuild_reply(self, peer: str, r: Message | None) -> None:
        rb = self.rebuild
        if rb is None or not self.running or not isinstance(r, pb.CatchUpReply):
            return
        rb.report(peer, int(r.committed_head), int(r.acceptor_high), bool(r.rebuilding), bool(r.knew_you))
        if r.HasField("control"):
            self.control.learn(r.control)
        if not self._snapshot(peer, r):  # (a snapshot asks the peer for the rest itself)
            self._learn_in_order(r.commits)
            if r.committed_head > self.log.head.version:
                self.catch_up(peer)
        if rb.decided:
            self._disarm("rebuild", 0)
            self._rebuild_decided()

    def _enrol(self, peer: str, enrolment: int) -> bool | None:
        """Record a voter's enrolment (CatchUpRequest.enrolment) durably, before the reply leaves. Returns
        whether it has enrolled here under another id (it ran before: Store.enrol), or None when the record
        cannot be made durable (then the request is not answered: an unrecorded answer would break rebuild's
        argument)."""
        if not enrolment or peer not in self.voters or peer == self.node_id:
            return False
        try:
            return self.store.enrol(peer, enrolment)
        except StoreFailed:
            self._store_failed()
            return None

    def _learn_in_order(self, commits: Iterable[pb.Commit]) -> None:
        """Learn a reply's commits from the one after our head on, stopping at the first that is refused."""
        for c in commits:
            if c.table.version == self.log.head.version + 1 and self._learned(c, None, broadcast=False)[1]:
                break

    def _snapshot(self, peer: str, r: pb.CatchUpReply) -> bool:
        """Install the head a peer sent because it compacted the versions we lack. True if one was installed."""
        if not (r.snapshot and len(r.commits) == 1 and r.commits[0].table.version > self.log.head.version + 1):
            return False
        v = int(r.commits[0].table.version)
        try:
            why = self.log.install_snapshot(r.commits[0], self.acceptor.states_above(v))
        except StoreFailed:
            self._store_failed()
            return False
        if why:
            log.warning("%s: snapshot of version %d from %s refused: %s", self.node_id, v, peer, why)
            return False
        if r.committed_head > self.log.head.version:
            self.catch_up(peer)
        return True

    def _rebuild_decided(self) -> None:
        self._abstains()
        deferred, self._deferred = self._deferred, []
        for _, table, plan, on_done in deferred:
            self.propose(table, plan, on_done)

    # ---- fail-stop on a store that cannot be written ---------------------------------------------
    @property
    def failure(self) -> str:
        """Why this node neither votes nor proposes now ("" while its store works and its history agrees with
        every certified table it has seen)."""
        if self.log.conflicts:
            return f"conflicting history: {self.log.conflicts[0]}"
        return self.store.failure

    def _persist(self, st: pb.AcceptorState) -> bool:
        """Make acceptor state durable; False (and fail-stop until the disk recovers) when it cannot be."""
        try:
            self.store.save_acceptor(st)
        except StoreFailed:
            self._store_failed()
            return False
        return True

    def _sign(self, reply: pb.Accepted, p: pb.Proposal) -> pb.Accepted:
        """Under mTLS, sign an accept (version, ballot, table hash) with this node's key, for the certificate."""
        if self.signer is not None and reply.ok:
            reply.signature = self.signer.sign(int(p.version), (int(p.ballot.round), p.ballot.node_id),
                                               p.table.content_hash)
            reply.certificate = self.signer.cert_der
        return reply

    def _store_failed(self) -> None:
        """Stop voting and proposing (every handler checks `store.failed`) and try the disk again every
        `disk_retry_ms`; catch-up fetches whatever was committed meanwhile once it works again."""
        if ("disk", 0) in self._timers:
            return

        def retry() -> None:
            if self.store.resume():
                for peer in sorted(self._peer_heads, key=lambda n: -self._peer_heads[n]):
                    if peer != self.node_id:
                        self.catch_up(peer)
                        break
            else:
                self._arm("disk", 0, self.cfg.disk_retry_ms / 1000.0, retry)

        self._arm("disk", 0, self.cfg.disk_retry_ms / 1000.0, retry)
