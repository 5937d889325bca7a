"""ControlNode: drives the control records (agent/consensus/control.py) over the consensus node's Transport,
Clock and Store. ConsensusNode holds one, serves its two RPCs (ControlAccept, ControlLearn), hands it the
certified record of each catch-up reply (anti-entropy every `sync_interval_ms`) and ticks it with its sync.

Order of effects as for tables: an acceptor's accept is durable before its ack leaves; a writer's own accept
is durable before its first send (it never reuses a key); a certified record is durable here before it is
adopted, reported (`on_change`) and sent on.

Writers (control.py, Writer): `handle(src, req)` takes a record from its writer `src` (the peer's certificate CN
under mTLS, the claimed sender in plaintext), or from a voter finishing it with the writer's signature, which a
writer sends with its record and a voter keeps with what it accepted (ControlState.writer); the writer must
be a voter or a member (`is_member`). Each refusal has a code (consensus.proto ControlRefusal) counted in
`refused`.

Signed (mTLS, `signer`): a voter signs each record it acks (`signing.control_digest`), the writer counts only
acks whose signature verifies and puts them in the ControlCommit, and every node adopts a certified record only
if each voter it names signed it (`VoteSigner.check_control`). So one member cannot certify a record by naming
a quorum that never accepted it (pause or resume every planner). During a rolling upgrade, a voter whose last
answer to this node said it runs a release before control signatures (`signs_control`: the gRPC transport
reads it off the answer's metadata, elasticmoe/versions.py CONTROL_SIGNED_KEY) may be named unsigned, and a
record written by such a node carries no signatures at all (its writer cannot collect them) and is checked by
its names alone, as before; a voter or writer this node has not heard from yet must sign (a refused record
comes again with the next anti-entropy round). Once every node runs this release, every name must be signed.
An operator's record names its admin (`ControlRecord.admin`): the voters sign fields 1 to 5 as every release does,
and the writer signs the whole record, admin included, in `ControlCommit.writer`; a certified record that names
an admin is adopted only with that signature. A record of a writer that runs the release before carries no
writer signature (and no admin): under mTLS only voters of that release finish it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from google.protobuf.message import Message

from agent.clock import Clock, Timer
from agent.consensus.control import ControlAcceptor, ControlWrite, Refusal, check_commit, describe, key
from agent.consensus.signing import VoteSigner
from agent.storage.store import Store, StoreFailed
from agent.transport import Transport
from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)

ControlCallback = Callable[[pb.ControlCommit], None]


@dataclass(frozen=True)
class ControlOutcome:
    """How one write of the switch ended: `committed` (certified by a quorum: `commit`), or why not."""

    committed: bool
    commit: pb.ControlCommit | None = None
    reason: str = ""


class ControlNode:
    """`abstains()`: why this node may not accept records now ("" while it may: ConsensusNode's own reason, so a
    learner, a failed disk or a drifted config refuses here as it does for tables); `members()`: non-voters that
    should learn records too; `store_failed()`: fail-stop after a write that failed; `wall_ms()`: now, for a
    record's `at_ms`; `signer` (mTLS): acks are signed and certified records checked (module docstring), with
    `signs_control(voter)` whether a voter's last answer said it signs them. `is_member(node)`: whether a non-voter may write records (a member of the
    cluster; default: one of `members()`). A write is given up after `deadline` seconds; messages time out after
    `timeout`."""

    def __init__(self, node_id: str, voters: list[str], store: Store, clock: Clock, transport: Transport, *,
                 timeout: float, deadline: float, max_attempts: int, abstains: Callable[[], str],
                 members: Callable[[], list[str]], store_failed: Callable[[], None],
                 wall_ms: Callable[[], int], signer: VoteSigner | None = None,
                 signs_control: Callable[[str], bool] = lambda _: True,
                 is_member: Callable[[str], bool] | None = None) -> None:
        self.node_id, self.voters, self.store, self.clock, self.transport = node_id, sorted(set(voters)), store, clock, transport
        self.signer, self.signs_control = signer, signs_control
        self.timeout, self.deadline, self.max_attempts = timeout, deadline, max_attempts
        self.abstains, self.members, self.store_failed, self.wall_ms = abstains, members, store_failed, wall_ms
        self.is_member = is_member or (lambda n: n in self.members())
        self.acceptor = self._acceptor(None)
        self.refused: dict[str, int] = {}  # refusals this node answered, by ControlRefusal name
        self._callbacks: list[ControlCallback] = []
        self._write: ControlWrite | None = None  # this node's own record on its way
        self._finishing: ControlWrite | None = None  # another writer's record this node completes
        self._given_up: tuple[int, str] | None = None  # the record a finish found superseded
        self._accepted_at = 0.0
        self._timers: set[Timer] = set()
        self.running = False

    # ---- lifecycle and view -----------------------------------------------------------------------
    def _acceptor(self, st: pb.ControlState | None) -> ControlAcceptor:
        return ControlAcceptor(self.node_id, self.voters, st, is_member=lambda n: self.is_member(n),
                               check_writer=self.signer.check_writer if self.signer is not None else None)

    def recover(self, st: pb.ControlState | None) -> None:
        """Adopt the state the store recovered (durable already: no callbacks) and start."""
        if st is not None:
            self.acceptor.apply(st)
        self._accepted_at = self.clock.now()
        self.running = True

    def stop(self) -> None:
        self.running = False
        for t in self._timers:
            t.cancel()
        self._timers.clear()

    @property
    def record(self) -> pb.ControlCommit | None:
        """The newest certified record known here (None: none yet)."""
        return self.acceptor.certified

    def on_change(self, cb: ControlCallback) -> None:
        """`cb(commit)` after each newer certified record is durable here."""
        self._callbacks.append(cb)

    def _later(self, delay: float, fn: Callable[[], None]) -> None:
        box: list[Timer] = []

        def fire() -> None:
            self._timers.discard(box[0])
            if self.running:
                fn()

        box.append(self.clock.call_later(delay, fire))
        self._timers.add(box[0])

    def _persist(self, st: pb.ControlState) -> bool:
        try:
            self.store.save_control(st)
        except StoreFailed:
            self.store_failed()
            return False
        self.acceptor.apply(st)
        return True

    # ---- writing the switch -----------------------------------------------------------------------
    def unready(self) -> str:
        return "node not running" if not self.running else self.abstains()

    def write(self, paused: bool, note: str, on_done: Callable[[ControlOutcome], None], admin: str = "") -> None:
        """Write a record saying `paused` (for `admin`, the operator who asked this node); `on_done` runs once,
        when a quorum certified it or this node gave up."""
        why = self.unready()
        if not why and self._write is not None:
            why = "a pause or resume is being written on this node already"
        if why:
            on_done(ControlOutcome(False, None, f"UNAVAILABLE: {why}"))
            return
        self._attempt(paused, note, admin, on_done, self.clock.now() + self.deadline, 1)

    def _attempt(self, paused: bool, note: str, admin: str, on_done: Callable[[ControlOutcome], None],
                 deadline: float, n: int) -> None:
        r = self.acceptor.next_record(paused, self.wall_ms(), note, admin)
        own = self.signer.sign_writer(r) if self.signer is not None else None
        reply, st = self.acceptor.on_accept(r, self.node_id, own)
        if st is None or not self._persist(st):  # durable before it leaves: this key is never used again
            on_done(ControlOutcome(False, None, f"UNAVAILABLE: {self.store.failure or reply.reason}"))
            return
        self._accepted_at = self.clock.now()
        w = self._write = ControlWrite(r, self.voters, writer=own)
        self._sign(reply, r)

        def end(ev: str) -> None:
            self._write = None
            if ev == "certified":
                self._certified(w)
                on_done(ControlOutcome(True, w.commit()))
            elif ev == "refused" and w.superseded and n < self.max_attempts and self.clock.now() < deadline:
                self._attempt(paused, note, admin, on_done, deadline, n + 1)  # above the higher key it was refused for
            else:
                others = sorted(w.acks - {self.node_id})
                after = (f"; {', '.join(others)} accepted it and may still complete it" if others else
                         "; no other voter said it accepted it, so the switch did not change")
                what = "refused" if ev == "refused" else f"no quorum of voters within {self.deadline:.1f} s"
                on_done(ControlOutcome(False, None, f"not committed ({what}): {w.tally()}{after}"))

        self._drive(w, deadline, end, reply)

    def _drive(self, w: ControlWrite, deadline: float, end: Callable[[str], None], own: pb.ControlAck) -> None:
        """Send `w` (with its writer's signature, under mTLS) to the voters that have not answered, every
        `timeout` until `deadline`; `end(event)` once."""
        def answer(src: str, r: Message | None) -> None:
            if not self.running or not isinstance(r, pb.ControlAck) or w.done:
                return
            if r.ok and (why := self._unsigned(src, r, w.record)):  # not counted: a certificate would not verify
                log.warning("%s: control record %s: the ack of %s is not counted: %s", self.node_id, w.record.seq,
                            src, why)
                return
            if r.HasField("certified"):
                self.learn(r.certified)
            if r.HasField("accepted"):  # a key above ours somewhere: the next record goes above it
                self.acceptor.heard = max(self.acceptor.heard, key(r.accepted))
            ev = w.on_ack(src, r)
            if ev:
                end(ev)

        def round_() -> None:
            if w.done:
                return
            if self.clock.now() >= deadline:
                w.done = True
                end("timeout")
                return
            req = pb.ControlAcceptRequest(record=w.record, from_node=self.node_id)
            if w.writer is not None:
                req.writer.CopyFrom(w.writer)
            for dst in w.waiting():
                if dst != self.node_id:
                    self.transport.call(dst, "Consensus/ControlAccept", req, self.timeout, partial(answer, dst))
            self._later(self.timeout, round_)

        answer(self.node_id, own)  # this node's own accept (counted when it is a voter)
        round_()

    def _certified(self, w: ControlWrite) -> None:
        c = w.commit()
        if not self.learn(c):
            for dst in sorted((set(self.voters) | set(self.members())) - {self.node_id}):
                self.transport.call(dst, "Consensus/ControlLearn", c, self.timeout, lambda r: None)

    # ---- completing another writer's record ---------------------------------------------------------
    def tick(self) -> None:
        """(Each sync.) Finish a record of another writer that this node accepted and has not seen certified since
        `deadline`: its writer gave up, or its learn did not get out (a partition right after it was certified)."""
        acc, cert = self.acceptor.accepted, self.record
        if (not self.running or acc is None or acc.node_id == self.node_id or self._finishing is not None
                or key(acc) <= key(cert.record if cert else None) or key(acc) == self._given_up
                or self.clock.now() - self._accepted_at < self.deadline or self.abstains()):
            return
        w = self._finishing = ControlWrite(acc, self.voters, writer=self.acceptor.writer)  # the writer's word, kept

        def end(ev: str) -> None:
            self._finishing = None
            if ev == "certified":
                log.info("%s: completed control record %s of %s", self.node_id, acc.seq, acc.node_id)
                self._certified(w)
            elif ev == "refused":  # superseded, or refused as not its writer's word: never tried again
                self._given_up = key(acc)
                log.warning("%s: gave up completing control record %s of %s: %s", self.node_id, acc.seq,
                            acc.node_id, w.tally())

        own = pb.ControlAck(ok=True, from_node=self.node_id)
        self._sign(own, acc)
        self._drive(w, self.clock.now() + self.deadline, end, own)

    # ---- serving ------------------------------------------------------------------------------------
    def handle(self, src: str, req: Message) -> Message | None:
        """Consensus/ControlAccept and Consensus/ControlLearn."""
        if not self.running:
            return None
        if isinstance(req, pb.ControlAcceptRequest):
            reply = self._accept(src, req)
            if not reply.ok:
                name = pb.ControlRefusal.Name(reply.code)
                self.refused[name] = self.refused.get(name, 0) + 1
                if reply.code not in (pb.CONTROL_SUPERSEDED, pb.CONTROL_UNAVAILABLE):
                    log.warning("%s: refused a control record from %s: %s", self.node_id, src[:64], reply.reason)
            return reply
        if isinstance(req, pb.ControlCommit):
            code, why = self._learn(req)
            ack = pb.ControlAck(ok=not why, from_node=self.node_id, reason=why, code=code)
            if why:
                name = pb.ControlRefusal.Name(code)
                self.refused[name] = self.refused.get(name, 0) + 1
            if self.record is not None:
                ack.certified.CopyFrom(self.record)
            return ack
        return None

    def _accept(self, src: str, req: pb.ControlAcceptRequest) -> pb.ControlAck:
        writer = req.writer if req.HasField("writer") else None
        code, denied = self.acceptor.admits(req.record, src, writer)  # who may send it, first: a forged record is
        if denied:  # refused as such by a learner or a failed disk too, not answered "try again later"
            return pb.ControlAck(ok=False, from_node=self.node_id, reason=f"PERMISSION_DENIED: {denied}", code=code)
        why = self.abstains()
        if why:
            return pb.ControlAck(ok=False, from_node=self.node_id, reason=f"UNAVAILABLE: {why}",
                                 code=pb.CONTROL_UNAVAILABLE)
        reply, st = self.acceptor.on_accept(req.record, src, writer)
        if st is not None:
            if not self._persist(st):
                return pb.ControlAck(ok=False, from_node=self.node_id, reason=f"UNAVAILABLE: {self.store.failure}",
                                     code=pb.CONTROL_UNAVAILABLE)
            self._accepted_at = self.clock.now()
        self._sign(reply, req.record)
        return reply

    def learn(self, c: pb.ControlCommit) -> str:
        """Adopt certified `c` if it is newer than ours (durably first); "" or why it was refused."""
        return self._learn(c)[1]

    def _learn(self, c: pb.ControlCommit) -> tuple[Refusal, str]:
        """`learn`, with the refusal's code."""
        why = check_commit(c, self.voters)
        if not why and self.signer is not None and self.must_sign(c.record.node_id):  # a writer that signs
            why = self.signer.check_control(c, self.must_sign)
        if not why and self.signer is not None and c.record.admin:  # who asked: the writer's word only
            why = (self.signer.check_writer(c.record, c.writer) if c.HasField("writer") else
                   f"record.admin = {c.record.admin[:64]!r} without the signature of its writer {c.record.node_id[:64]}")
        if why:
            return pb.CONTROL_BAD_COMMIT, f"INVALID_ARGUMENT: {why}"
        st = self.acceptor.learn(c)
        if st is None:
            return pb.CONTROL_REFUSAL_UNSPECIFIED, ""
        if not self._persist(st):
            return pb.CONTROL_UNAVAILABLE, f"UNAVAILABLE: {self.store.failure}"
        log.info("%s: cluster switch: %s", self.node_id, describe(c))
        for cb in self._callbacks:
            cb(c)
        return pb.CONTROL_REFUSAL_UNSPECIFIED, ""

    # ---- signatures (mTLS) ------------------------------------------------------------------------------
    def must_sign(self, voter: str) -> bool:
        """Whether `voter`'s name in a certified record needs its signature: under mTLS, unless its last answer
        to this node said it runs a release before control signatures (a rolling upgrade's older release)."""
        return self.signer is not None and (voter == self.node_id or self.signs_control(voter))

    def _sign(self, ack: pb.ControlAck, r: pb.ControlRecord) -> None:
        """Under mTLS, sign an ok ack of record `r` with this node's key."""
        if self.signer is not None and ack.ok:
            ack.signature = self.signer.sign_control(r)
            ack.certificate = self.signer.cert_der

    def _unsigned(self, src: str, a: pb.ControlAck, r: pb.ControlRecord) -> str:
        """Why ok ack `a` of `src` for record `r` may not be counted under mTLS (its signature is missing where
        needed, or does not verify), or ""."""
        if self.signer is None:
            return ""
        if not a.signature:
            return "no signature" if self.must_sign(src) else ""
        c = pb.ControlCommit(record=r, voters=[src], signatures=[pb.VoteSignature(
            voter=src, certificate=a.certificate, signature=a.signature)])
        return self.signer.check_control(c, self.must_sign)
