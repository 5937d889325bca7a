"""ConsensusNode: drives the sans-IO Paxos core (paxos.py) over a Transport, a Clock and a Store.

The node owns its lifecycle, the acceptor's handlers and the learner; it holds two named parts, each with its
own state: `proposer` (proposer.py: this node's proposals and their ballots) and `recovery` (recovery.py:
rebuild after store loss, snapshots, fail-stop), and one `Timers` table the three share (core.py).

Order of effects, as in etcd-raft's Ready: persist (fsync) -> send -> install. An acceptor's promise or
accept is durable before its reply leaves; a proposer's ballot is durable before its first message (the
round-0 owner of v + 1 reserves its round in the same write as the commit of v, so its proposal can leave
while its own accept is being written; its vote counts once that write is done); a commit is durable
before it is broadcast and before it is installed (on_commit callbacks, shims).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import zlib
from collections import deque
from collections.abc import Callable
from functools import partial

from google.protobuf.message import Message

from agent.clock import Clock
from agent.config import ConsensusConfig
from agent.consensus.controlnode import ControlNode
from agent.consensus.core import Outcome, Timers
from agent.consensus.log import CommittedLog, parent_hash_mismatch, shape_mismatch
from agent.consensus.paxos import Acceptor, BallotAttempt, Verdict, quorum_size
from agent.consensus.proposer import Proposer
from agent.consensus.rebuild import Rebuild
from agent.consensus.recovery import Recovery
from agent.consensus.refusal import Refusal
from agent.consensus.signing import VoteSigner
from agent.storage.store import Store, StoreFailed
from agent.transport import Transport
from controlplane.errors import InvalidTable
from controlplane.table import RoutingTable
from elasticmoe.codec import TableWireError, table_from_pb, table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb

__all__ = ["CommitCallback", "ConsensusNode", "Outcome", "Verifier", "validity_verifier"]

log = logging.getLogger(__name__)

Verifier = Callable[[RoutingTable, RoutingTable, pb.Plan], tuple[bool, float, str]]
CommitCallback = Callable[[pb.Commit, RoutingTable], None]


def validity_verifier(head: RoutingTable, proposed: RoutingTable, plan: pb.Plan) -> tuple[bool, float, str]:
    """Default verification: the proposed table is a valid table (the lead plugs in replay verification)."""
    try:
        proposed.validate()
    except InvalidTable as e:
        return False, 0.0, f"invalid table: {e.message}"
    return True, plan.verified_gain, ""


class ConsensusNode:
    def __init__(self, node_id: str, voters: list[str], store: Store, clock: Clock, transport: Transport,
                 cfg: ConsensusConfig, head: RoutingTable, verifier: Verifier = validity_verifier,
                 live_voters: Callable[[], list[str]] | None = None,
                 members: Callable[[], list[str]] | None = None, rng: random.Random | None = None,
                 had_store: bool = False, signer: VoteSigner | None = None, enrolment: int | None = None,
                 gate: Callable[[], str] | None = None, wall_ms: Callable[[], int] | None = None,
                 signs_control: Callable[[str], bool] | None = None,
                 is_member: Callable[[str], bool] | None = None) -> None:
        """`gate()`: why this node must neither vote nor propose now beyond its own state ("" while it may: the
        cluster fingerprint check, agent.fingerprint); `wall_ms()`: the wall clock for control records' at_ms;
        `signs_control(voter)`: whether a voter's last answer said it signs control records (the gRPC
        transport's; default: every voter does); `is_member(node)`: whether a non-voter may write control
        records (default: one of `members()`), agent.consensus.controlnode."""
        if not voters:
            raise ValueError("voters is empty: expected at least one configured voter")
        self.node_id = node_id
        self.voters = sorted(set(voters))
        self.quorum = quorum_size(len(self.voters))
        self.store, self.clock, self.transport, self.cfg = store, clock, transport, cfg
        self.verifier = verifier
        self.live_voters = live_voters or (lambda: self.voters)
        self.members = members or (lambda: [])  # non-voting learners that should receive commits
        self.gate = gate or (lambda: "")
        self.rng = rng or random.Random(zlib.crc32(node_id.encode()))
        self.timeout = cfg.accept_timeout_ms / 1000.0
        self.signer = signer  # under mTLS: votes are signed, and certificates checked for every signature
        self.running = False
        self.timers = Timers(clock, lambda: self.running)  # one table for the node's and its parts' timers
        self._peer_heads: dict[str, int] = {}
        self.recovery = Recovery(self, node_id=node_id, voters=self.voters, cfg=cfg, clock=clock, transport=transport,
                                 store=store, timers=self.timers, timeout=self.timeout,
                                 enrolment=enrolment or int.from_bytes(os.urandom(8), "little") | 1,
                                 peer_heads=self._peer_heads)
        self.proposer = Proposer(self, node_id=node_id, voters=self.voters, cfg=cfg, clock=clock, transport=transport,
                                 store=store, timers=self.timers, timeout=self.timeout, rng=self.rng,
                                 live_voters=self.live_voters, peer_heads=self._peer_heads,
                                 persist=self.recovery.persist)
        self.log = CommittedLog(store, self.voters, head, self._installed, max_buffered=4 * cfg.catchup_batch,
                                ride_along=self.proposer.preburn,
                                verify_qc=signer.check_certificate if signer is not None else None)

        self._callbacks: list[CommitCallback] = []
        self._last_attempt: BallotAttempt | None = None  # the attempt of ours whose commit is being learned
        self._catching_up = ""
        self.acceptor = Acceptor(node_id, self.voters)
        self.had_store = had_store  # this node ran before (its data_dir says so): an empty store was lost
        # the pause switch: control records on the same voters, store and transport (agent/consensus/control.py)
        self.control = ControlNode(node_id, self.voters, store, clock, transport, timeout=self.timeout,
                                   deadline=2 * cfg.max_attempts * self.timeout, max_attempts=cfg.max_attempts,
                                   abstains=self.recovery.cannot_vote, members=lambda: self.members(),
                                   store_failed=self.recovery.store_failed,
                                   wall_ms=wall_ms or (lambda: int(time.time() * 1000)), signer=signer,
                                   signs_control=signs_control or (lambda _: True), is_member=is_member)

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        rec = self.store.open()
        self.log.recover(rec)
        self.acceptor = Acceptor(self.node_id, self.voters, rec.acceptor)
        self.acceptor.prune(self.log.head.version)
        self.control.recover(rec.control)
        self.recovery.start(rec, self.had_store)
        self.running = True
        self.transport.serve(self._handle, service="Consensus")
        self.recovery.ask_rebuild()
        for v, st in self.acceptor.states.items():
            if st.HasField("accepted"):
                self.proposer.resume(v)
        self._arm_sync()

    def stop(self) -> None:
        self.running = False
        self.control.stop()
        self.timers.cancel_all()
        self.proposer.stop()
        self.store.close()

    # ---- public API -------------------------------------------------------------------------------
    @property
    def head(self) -> RoutingTable:
        return self.log.head

    @property
    def conflicts(self) -> list[str]:
        return self.log.conflicts

    @property
    def role(self) -> str:
        """"voter", "non-voter", or what a rebuilding node is now (agent.consensus.rebuild)."""
        return self.recovery.role

    @property
    def abstains(self) -> str:
        return self.recovery.abstains

    @property
    def failure(self) -> str:
        return self.recovery.failure

    @property
    def rebuild(self) -> Rebuild | None:
        return self.recovery.rebuild

    @property
    def rejections(self) -> deque[tuple[int, str, str]]:
        return self.proposer.rejections

    async def close(self) -> None:
        """Nothing beyond stop(): the transport and the store belong to the caller."""

    def committed(self, version: int) -> pb.Commit | None:
        return self.log.commits.get(version)

    def commits_since(self, version: int) -> list[pb.Commit]:
        return self.log.since(version)

    def peer_heads(self) -> dict[str, int]:
        """The committed head each peer last reported to us (ours included)."""
        return {**self._peer_heads, self.node_id: self.log.head.version}

    def on_commit(self, cb: CommitCallback) -> None:
        self._callbacks.append(cb)

    def propose(self, table: RoutingTable, plan: pb.Plan, on_done: Callable[[Outcome], None]) -> None:
        """Propose `table` as version head + 1. `on_done` runs once, with the outcome."""
        v = table.version
        now = self.clock.now()
        why = ""
        if not self.running:
            why = "node not running"
        elif v != self.log.head.version + 1 or table.parent != self.log.head.version:
            why = f"table version {v} parent {table.parent}: expected version {self.log.head.version + 1} parent {self.log.head.version}"
        elif table.parent_hash != self.log.head.digest:
            why = f"table version {v}: {parent_hash_mismatch(table, self.log.head)}"
        elif v in self.proposer.pending:
            why = f"a proposal for version {v} is already in flight here"
        elif self.recovery.deciding():
            self.recovery.deferred.append((now, table, plan, on_done))  # just started: it knows within a round trip
            return
        elif self.recovery.cannot_vote():
            why = f"UNAVAILABLE: {self.recovery.cannot_vote()}"
        if why:
            on_done(Outcome(False, v, why))
            return
        value = pb.Proposal(version=v, table=table_to_pb(table), plan=plan, proposer=self.node_id)
        self.proposer.propose(value, on_done, now)

    def catch_up(self, peer: str) -> None:
        """Fetch and install the commits `peer` has beyond our head (one request in flight at a time)."""
        if not self.running or self._catching_up or peer == self.node_id:
            return
        self._catching_up = peer
        req = pb.CatchUpRequest(from_version=self.log.head.version, from_node=self.node_id, limit=self.cfg.catchup_batch)
        self.transport.call(peer, "Consensus/CatchUp", req, self.timeout, lambda r: self._on_catchup(peer, r))

    def _arm_sync(self) -> None:
        if self.cfg.sync_interval_ms <= 0:
            return
        delay = self.cfg.sync_interval_ms / 1000.0 * (0.5 + self.rng.random())

        def tick() -> None:
            peers = [p for p in self.voters if p != self.node_id]
            if peers:
                self.catch_up(self.rng.choice(peers))
            self.control.tick()
            self._arm_sync()

        self.timers.arm("sync", 0, delay, tick)

    # ---- acceptor side ------------------------------------------------------------------------------
    def _handle(self, src: str, method: str, req: Message) -> Message | None:
        if not self.running:
            return None
        if method in ("Consensus/ControlAccept", "Consensus/ControlLearn"):
            return self.control.handle(src, req)
        head = self.log.head.version
        abstains = self.recovery.cannot_vote() if method in ("Consensus/Prepare", "Consensus/Accept") else ""
        if abstains:
            # fail-stop (a vote that cannot be made durable is never given), or rebuilding after store loss
            why = f"UNAVAILABLE: {abstains}"
            if isinstance(req, pb.PrepareRequest):
                return pb.Promise(ok=False, from_node=self.node_id, committed_head=head, reason=why,
                                  code=pb.REFUSAL_UNAVAILABLE)
            if isinstance(req, pb.AcceptRequest):
                return pb.Accepted(ok=False, from_node=self.node_id, committed_head=head,
                                   ballot=req.proposal.ballot, reason=why, code=pb.REFUSAL_UNAVAILABLE)
        if method == "Consensus/Prepare" and isinstance(req, pb.PrepareRequest):
            if req.ballot.node_id != src:  # a proposer only ever uses its own ballots
                return pb.Promise(ok=False, from_node=self.node_id, committed_head=head,
                                  reason=f"ballot.node_id = {req.ballot.node_id!r}: expected the sender {src!r}",
                                  code=pb.REFUSAL_INVALID_ARGUMENT)
            promise, st = self.acceptor.on_prepare(req, self.log.head.version)
            if st is not None:
                if not self.recovery.persist(st):  # persist before the reply leaves
                    return pb.Promise(ok=False, from_node=self.node_id, committed_head=head,
                                      reason=f"UNAVAILABLE: {self.recovery.failure}", code=pb.REFUSAL_UNAVAILABLE)
                self.acceptor.apply(st)
            elif req.version > self.log.head.version + 1:
                self.catch_up(src)
            return promise
        if method == "Consensus/Accept" and isinstance(req, pb.AcceptRequest):
            if req.proposal.ballot.node_id != src:  # else a member could spend another's round 0 (I1)
                return pb.Accepted(ok=False, from_node=self.node_id, committed_head=head, ballot=req.proposal.ballot,
                                   reason=f"ballot.node_id = {req.proposal.ballot.node_id!r}: expected the sender "
                                          f"{src!r}", code=pb.REFUSAL_INVALID_ARGUMENT)
            reply, st = self.acceptor.on_accept(req, self.log.head.version, self.check)
            v = int(req.proposal.version)
            if st is not None:
                if not self.recovery.persist(st):
                    return pb.Accepted(ok=False, from_node=self.node_id, committed_head=head,
                                       ballot=req.proposal.ballot, reason=f"UNAVAILABLE: {self.recovery.failure}",
                                       code=pb.REFUSAL_UNAVAILABLE)
                self.acceptor.apply(st)
                self.sign(reply, req.proposal)
                self.proposer.voted(v)  # it finishes v itself if v's proposer goes quiet
            elif v > self.log.head.version + 1:
                self.catch_up(src)
            return reply
        if method == "Consensus/Learn" and isinstance(req, pb.Commit):
            code, why = self.learned(req, src, broadcast=False)
            return pb.CommitAck(ok=not why, from_node=self.node_id, committed_head=self.log.head.version, reason=why,
                                code=code)
        if method == "Consensus/CatchUp" and isinstance(req, pb.CatchUpRequest):
            knew = self.recovery.enrol(src, int(req.enrolment))
            if knew is None:
                return None  # an enrolment that cannot be recorded is not answered (agent/consensus/rebuild.py)
            reply = self.log.catchup_reply(req, self.cfg.catchup_batch)
            reply.knew_you = knew
            self.recovery.peer_is_up(src)
            reply.acceptor_high = max(self.acceptor.states, default=0)
            reply.rebuilding = self.recovery.rebuild is not None
            if self.control.record is not None:
                reply.control.CopyFrom(self.control.record)
            return reply
        return None

    def check(self, p: pb.Proposal) -> Verdict:
        """A voter's own verification of a proposal whose version and parent already match its head."""
        bad = pb.REFUSAL_INVALID_ARGUMENT
        for name in ("estimated_gain", "verified_gain", "cost"):
            x = getattr(p.plan, name)
            if not math.isfinite(x):
                return Verdict(False, 0.0, f"INVALID_ARGUMENT: plan.{name} = {x}: expected a finite number", bad)
        try:
            table = table_from_pb(p.table, self.log.head.topology)
        except TableWireError as e:
            return Verdict(False, 0.0, f"INVALID_ARGUMENT: {e}", bad)
        why = shape_mismatch(table, self.log.head)
        if why:
            return Verdict(False, 0.0, f"INVALID_ARGUMENT: {why}", bad)
        if table.version != p.version or table.parent != self.log.head.version:
            return Verdict(False, 0.0, f"table version {table.version} parent {table.parent}: expected {p.version} on "
                           f"{self.log.head.version}", pb.REFUSAL_PARENT_MISMATCH)
        if table.parent_hash != self.log.head.digest:  # built on another table for our head's version
            return Verdict(False, 0.0, parent_hash_mismatch(table, self.log.head), pb.REFUSAL_PARENT_MISMATCH)
        try:  # what the plan must show on this node's replay is the verifier's to say (agent.decision.voter.Voter)
            return Verdict(*self.verifier(self.log.head, table, p.plan))
        except Exception as e:  # a verifier bug must not take the acceptor down; it votes no and says why
            log.exception("verifier raised on version %d", p.version)
            return Verdict(False, 0.0, f"verifier raised {type(e).__name__}: {e}")

    def sign(self, reply: pb.Accepted, p: pb.Proposal) -> pb.Accepted:
        """Under mTLS, sign an accept (version, ballot, table hash) with this node's key, for the certificate."""
        if self.signer is not None and reply.ok:
            reply.signature = self.signer.sign(int(p.version), (int(p.ballot.round), p.ballot.node_id),
                                               p.table.content_hash)
            reply.certificate = self.signer.cert_der
        return reply

    # ---- learner ------------------------------------------------------------------------------------
    def learned(self, c: pb.Commit, src: str | None, broadcast: bool,
                 attempt: BallotAttempt | None = None) -> tuple[Refusal, str]:
        """Offer a certified commit to the log; as its proposer, send it on between persist and install."""
        self._last_attempt = attempt
        try:
            code, why, behind = self.log.offer(c, self._broadcast_commit if broadcast else None)
        except StoreFailed:
            self.recovery.store_failed()
            return pb.REFUSAL_UNAVAILABLE, f"UNAVAILABLE: {self.recovery.failure}"
        if behind and src is not None:
            self.catch_up(src)
        return code, why

    def _broadcast_commit(self, c: pb.Commit) -> None:
        for dst in sorted((set(self.voters) | set(self.members())) - {self.node_id}):
            self.transport.call(dst, "Consensus/Learn", c, self.timeout, partial(self._saw_head, dst))

    def _saw_head(self, src: str, r: Message | None) -> None:
        """A Learn's reply: the CommitAck says which head the peer holds (None: the call failed)."""
        if isinstance(r, pb.CommitAck) and self.running:
            self._peer_heads[src] = int(r.committed_head)
            if r.committed_head > self.log.head.version:
                self.catch_up(src)

    def _installed(self, c: pb.Commit, table: RoutingTable) -> None:
        v = table.version
        self.proposer.adopt_burn()
        attempt, self._last_attempt = self._last_attempt, None
        self.acceptor.prune(v)
        self.proposer.installed(c, v, attempt)
        for cb in self._callbacks:
            cb(c, table)
        if 0 < self.cfg.log_compact_bytes < self.store.size:
            kept = self.log.trim(self.cfg.log_retain)
            self.store.compact(kept, self.acceptor.states_above(v))

    def _on_catchup(self, peer: str, r: Message | None) -> None:
        self._catching_up = ""
        if not self.running or not isinstance(r, pb.CatchUpReply):
            return
        self._peer_heads[peer] = int(r.committed_head)
        if r.HasField("control"):
            self.control.learn(r.control)
        before = self.log.head.version
        if self.recovery.snapshot(peer, r):
            return
        self.recovery.learn_in_order(r.commits)
        if r.committed_head > self.log.head.version > before:
            self.catch_up(peer)
