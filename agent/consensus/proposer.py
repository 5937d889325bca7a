"""The Proposer part of ConsensusNode: this node's proposals, the ballots (BallotAttempt) tried for each, their
retries and outcomes, and the takeover of a version another proposer left accepted.

Its own state: `pending` (one Pending per version proposed here), the attempts in flight, the takeover counts,
round 0 reserved with the commit before it (`preburn`), accept round trips (for the thrifty first wave) and
`rejections`. The node gives it its fixed collaborators at construction and answers the rest through
`ProposerNode`: the acceptor and log (the acceptor is replaced at start), the voter's own verdict and
signature, learning a chosen commit, catch-up. Making a state durable is the Recovery part's `persist`
(fail-stop), passed in.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

from google.protobuf.message import Message

from agent.clock import Clock
from agent.config import ConsensusConfig
from agent.consensus.core import Outcome, Timers
from agent.consensus.paxos import Acceptor, BallotAttempt, Verdict, ballot_of, round0_owner
from agent.consensus.refusal import CONTESTED, Refusal
from agent.storage.store import Store
from agent.transport import Transport
from elasticmoe.v1 import consensus_pb2 as pb

if TYPE_CHECKING:
    from agent.consensus.log import CommittedLog

VOTER_REASON_MAX = 200  # characters of one voter's reason in an outcome: a peer's reply cannot make it unbounded


def voters_not_counted(att: BallotAttempt) -> str:
    """Who kept `att` from its quorum: each voter that refused, with its reason (cut to VOTER_REASON_MAX), then
    those that have not answered the current phase ("no reply from n3, n4")."""
    def clip(r: str) -> str:
        return r if len(r) <= VOTER_REASON_MAX else r[:VOTER_REASON_MAX - 3] + "..."

    answered = att.promises if att.phase == 1 else att.accepts
    said = [f"{k}: {clip(r)}" for k, r in sorted(att.rejects.items())]
    silent = [k for k in att.voters if k not in answered and k not in att.rejects]
    return "; ".join(said + ([f"no reply from {', '.join(silent)}"] if silent else []))


@dataclass
class Pending:
    value: pb.Proposal
    on_done: Callable[[Outcome], None]
    t0: float
    attempts: int = 0
    votes: list[pb.Vote] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


class ProposerNode(Protocol):
    """What the proposer asks of its node (ConsensusNode)."""

    running: bool
    acceptor: Acceptor
    log: CommittedLog

    def check(self, p: pb.Proposal) -> Verdict:
        """This node's verdict on a proposal as a voter."""

    def sign(self, reply: pb.Accepted, p: pb.Proposal) -> pb.Accepted:
        """Sign an accept (under mTLS), or return it as it is."""

    def learned(self, c: pb.Commit, src: str | None, broadcast: bool,
                attempt: BallotAttempt | None = None) -> tuple[Refusal, str]:
        """Learn a commit (persist, send it on as its proposer, install)."""

    def catch_up(self, peer: str) -> None:
        """Fetch and install the commits `peer` has beyond our head."""


class Proposer:
    """ConsensusNode's proposer part (see the module docstring). The node calls propose, resume, voted,
    adopt_burn, installed, stop and (through the log) preburn; the rest is the proposer's own."""

    def __init__(self, node: ProposerNode, *, node_id: str, voters: list[str], cfg: ConsensusConfig, clock: Clock,
                 transport: Transport, store: Store, timers: Timers, timeout: float, rng: random.Random,
                 live_voters: Callable[[], list[str]], peer_heads: dict[str, int],
                 persist: Callable[[pb.AcceptorState], bool]) -> None:
        self.node = node
        self.node_id, self.voters, self.cfg = node_id, voters, cfg
        self.clock, self.transport, self.store, self.timers = clock, transport, store, timers
        self.timeout, self.rng, self.live_voters = timeout, rng, live_voters
        self.peer_heads = peer_heads  # the node's: every reply says which head its sender holds
        self.persist = persist  # the Recovery part's: durable, or fail-stop
        self.pending: dict[int, Pending] = {}  # proposals made here, by version, until their outcome
        self._attempts: dict[int, BallotAttempt] = {}
        self._recoveries: dict[int, int] = {}  # takeovers started per version this node did not propose
        self._preburned: set[int] = set()  # versions whose round 0 this incarnation reserved durably, unused
        self._burn_written: pb.AcceptorState | None = None
        self._rtt: dict[str, float] = {}  # smoothed accept round trips, for the thrifty first wave
        self._accept_rest: dict[int, tuple[BallotAttempt, pb.AcceptRequest, list[str]]] = {}
        # (version, voter, reason) of recent refusals, for explain
        self.rejections: deque[tuple[int, str, str]] = deque(maxlen=256)

    # ---- what the node asks of it -------------------------------------------------------------------
    def propose(self, value: pb.Proposal, on_done: Callable[[Outcome], None], now: float) -> None:
        """Propose `value` (version head + 1, already checked by the node); `on_done` runs once."""
        v = int(value.version)
        self.pending[v] = Pending(value, on_done, now)
        owner = round0_owner(v, self.voters)
        if owner == self.node_id:  # round 0 if still ours to use, else a prepare at once: never wait for ourselves
            self._start_attempt(v, fast=self._round0_free(v))
        elif owner not in self.live_voters():
            self._start_attempt(v, fast=False)  # the round-0 owner is down: prepare at once
        else:
            self.timers.arm("takeover", v, self.timeout, lambda: self._recover(v))  # give the owner its turn

    def resume(self, v: int) -> None:
        """At start: this node holds an accepted value for v; finish it should its proposer stay quiet."""
        self.timers.arm("takeover", v, self._takeover_delay(), partial(self._recover, v))

    def voted(self, v: int) -> None:
        """This node just accepted a value for v as a voter: finish it ourselves if its proposer goes quiet."""
        self._recoveries.pop(v, None)
        if v not in self._attempts:
            self.timers.arm("takeover", v, self._takeover_delay(), lambda: self._recover(v))

    def adopt_burn(self) -> None:
        """The commit that carried `preburn`'s write is durable: round 0 of the next version is ours to use."""
        st, self._burn_written = self._burn_written, None
        if st is not None:
            self.node.acceptor.apply(st)
            self._preburned.add(int(st.version))

    def installed(self, c: pb.Commit, v: int, attempt: BallotAttempt | None) -> None:
        """Version v is installed (`c`, which `attempt` of ours chose, if any): forget its ballots and report
        the outcome of our proposal for it."""
        self._attempts.pop(v, None)
        self.timers.disarm("attempt", v)
        self.timers.disarm("takeover", v)
        self.timers.disarm("thrifty", v)
        self._accept_rest.pop(v, None)
        self._recoveries.pop(v, None)
        pend = self.pending.get(v)
        if pend is not None:
            mine = c.qc.table_hash == pend.value.table.content_hash
            votes = attempt.votes() if attempt is not None else list(c.votes)
            reason = "" if mine else f"version {v} committed another table (proposer {c.proposer})"
            self._finish(v, Outcome(mine, v, reason, votes, self.clock.now() - pend.t0, c))

    def stop(self) -> None:
        """The node stopped: every proposal still pending fails."""
        for v, p in list(self.pending.items()):
            self._finish(v, Outcome(False, v, "node stopped", p.votes, self.clock.now() - p.t0))

    def preburn(self, v: int) -> list[pb.AcceptorState]:
        """Written with the commit of v: if we own round 0 of v + 1, mark it used on disk now, so that the
        proposal for v + 1 can leave before our own accept is durable (after a restart we never reuse it)."""
        nxt = v + 1
        acceptor = self.node.acceptor
        if round0_owner(nxt, self.voters) != self.node_id or acceptor.state(nxt).proposer_round != 0:
            return []
        st = pb.AcceptorState()
        st.CopyFrom(acceptor.state(nxt))
        st.proposer_round = 1
        self._burn_written = st  # adopted by adopt_burn, which runs only once the write is durable
        return [st]

    # ---- attempts ---------------------------------------------------------------------------------------
    def _takeover_delay(self) -> float:
        return self.timeout * (1.0 + self.rng.random())  # jitter breaks duels between recovering voters

    def _recover(self, v: int) -> None:
        """Timeout for version v: retry our own proposal, or finish one another proposer left accepted."""
        if v != self.node.log.head.version + 1 or v in self._attempts:
            return
        if v not in self.pending:
            n = self._recoveries.get(v, 0)
            if n >= self.cfg.max_attempts or self.node.acceptor.accepted(v)[1] is None:
                return
            self._recoveries[v] = n + 1
        self._start_attempt(v, fast=False)

    def _round0_free(self, v: int) -> bool:
        """Round 0 of v is ours to use: never used (or burned with the commit of v - 1 for this use), and no
        promise to a higher ballot (any prepare is at round >= 1) would refuse our own accept."""
        st = self.node.acceptor.state(v)
        return not st.HasField("promised") and (st.proposer_round == 0 or v in self._preburned)

    def _start_attempt(self, v: int, fast: bool, min_round: int = 1) -> None:
        pend = self.pending.get(v)
        if pend is not None:
            pend.attempts += 1
        st = self.node.acceptor.state(v)
        if fast:
            rnd = 0
        else:
            promised = ballot_of(st.promised) if st.HasField("promised") else (0, "")
            rnd = max(1, min_round, int(st.proposer_round), promised[0] + 1)
        att = BallotAttempt(self.node_id, v, (rnd, self.node_id), self.voters, pend.value if pend else None)
        self._attempts[v] = att
        me_voter = self.node_id in self.voters
        new = pb.AcceptorState()
        if rnd == 0:
            req0 = att.accept_request()
            reply, new_st = self.node.acceptor.on_accept(req0, self.node.log.head.version, self.node.check)
            self.node.sign(reply, req0.proposal)
            if new_st is None:
                if reply.code == pb.REFUSAL_PROMISED:  # a higher ballot got here first: prepare above it at once
                    del self._attempts[v]
                    self._start_attempt(v, fast=False)
                    return
                att.refused(self.node_id, reply.reason, reply.code)
                self._attempt_failed(v, att, f"own check: {reply.reason}", retry=False)
                return
            new.CopyFrom(new_st)
        else:
            new.CopyFrom(st)
            promise = None
            if me_voter:
                promise, new_st = self.node.acceptor.on_prepare(att.prepare_request(), self.node.log.head.version)
                if new_st is not None:
                    new.CopyFrom(new_st)
        new.proposer_round = max(int(new.proposer_round), rnd + 1)
        self.timers.arm("attempt", v, self.timeout, lambda: self._attempt_timeout(v, att))
        if rnd == 0 and v in self._preburned:
            # round 0 is already durably ours: send first, make our own accept durable meanwhile, and
            # count our vote only once it is (the disk write overlaps the network round trip)
            self._preburned.discard(v)
            self.node.acceptor.apply(new)
            self._broadcast_accept(v, att)

            def own_vote() -> None:
                if not self.node.running or self._attempts.get(v) is not att:
                    return
                cur = self.node.acceptor.state(v)
                if cur is new:
                    if not self.persist(new):
                        self._attempt_failed(v, att, f"UNAVAILABLE: {self.store.failed}", retry=False)
                        return
                elif not (cur.HasField("accepted") and ballot_of(cur.accepted_ballot) == att.ballot):
                    return  # a higher ballot replaced our accept before it was durable: no vote from us
                self._step(v, att, att.on_accepted(self.node_id, reply))

            self.clock.call_later(0.0, own_vote)
            return
        self._preburned.discard(v)
        if not self.persist(new):  # persist the ballot (and our own promise/accept) before sending
            self._attempt_failed(v, att, f"UNAVAILABLE: {self.store.failed}", retry=False)
            return
        self.node.acceptor.apply(new)
        if rnd == 0:
            self._step(v, att, att.on_accepted(self.node_id, reply))
            self._broadcast_accept(v, att)
        else:
            if promise is not None:
                self._step(v, att, att.on_promise(self.node_id, promise))
            if self._attempts.get(v) is att and att.phase == 1:
                req = att.prepare_request()
                for dst in self.voters:
                    if dst != self.node_id:
                        self.transport.call(dst, "Consensus/Prepare", req, self.timeout,
                                            partial(self._on_promise, v, att, dst))

    def _broadcast_accept(self, v: int, att: BallotAttempt) -> None:
        """Send the accept to just enough voters for a quorum (live ones first, fastest recently first), and
        to the others after `thrifty_ms` or at the first refusal or failure: fewer disk writes and wake-ups
        per commit, the same outcome (`thrifty_ms = 0` sends to every voter at once)."""
        req = att.accept_request()
        others = [d for d in self.voters if d != self.node_id]
        if self.cfg.thrifty_ms > 0:
            live = set(self.live_voters())
            n = len(self.voters)
            others.sort(key=lambda d: (d not in live, self._rtt.get(d, 0.0), (self.voters.index(d) - v) % n))
            k = att.quorum - (1 if self.node_id in self.voters else 0)
            first, rest = others[:k], others[k:]
        else:
            first, rest = others, []
        self._accept_rest[v] = (att, req, rest)
        for dst in first:
            self._send_accept(v, att, req, dst)
        if rest:
            self.timers.arm("thrifty", v, self.cfg.thrifty_ms / 1000.0, lambda: self._accept_the_rest(v, att))

    def _send_accept(self, v: int, att: BallotAttempt, req: pb.AcceptRequest, dst: str) -> None:
        t0 = self.clock.now()
        self.transport.call(dst, "Consensus/Accept", req, self.timeout,
                            lambda r: self._on_accepted(v, att, dst, r, self.clock.now() - t0))

    def _accept_the_rest(self, v: int, att: BallotAttempt) -> None:
        entry = self._accept_rest.get(v)
        if entry is None or entry[0] is not att or att.done:
            return
        self.timers.disarm("thrifty", v)
        self._accept_rest[v] = (att, entry[1], [])
        for dst in entry[2]:
            self._send_accept(v, att, entry[1], dst)

    def _on_promise(self, v: int, att: BallotAttempt, src: str, r: Message | None) -> None:
        if self.node.running and isinstance(r, pb.Promise):
            self.peer_heads[src] = int(r.committed_head)
            if self._attempts.get(v) is att:
                self._step(v, att, att.on_promise(src, r))

    def _on_accepted(self, v: int, att: BallotAttempt, src: str, r: Message | None, rtt: float = 0.0) -> None:
        if not self.node.running:
            return
        if isinstance(r, pb.Accepted):
            self.peer_heads[src] = int(r.committed_head)
            self._rtt[src] = 0.8 * self._rtt.get(src, rtt) + 0.2 * rtt
        else:
            self._rtt[src] = self.timeout  # failed: try it last next time
        if self._attempts.get(v) is not att:
            return
        if not isinstance(r, pb.Accepted) or not r.ok:
            self._accept_the_rest(v, att)  # a thrifty first wave that cannot make it alone
        if isinstance(r, pb.Accepted):
            if not r.ok:
                self.rejections.append((v, src, r.reason))
            self._step(v, att, att.on_accepted(src, r))

    def _step(self, v: int, att: BallotAttempt, ev: str) -> None:
        if ev == "accept":
            if self.node_id in self.voters:  # accept our own value first, durably
                req = att.accept_request()
                reply, st = self.node.acceptor.on_accept(req, self.node.log.head.version, self.node.check)
                self.node.sign(reply, req.proposal)
                if st is not None:
                    st.proposer_round = max(int(st.proposer_round), int(self.node.acceptor.state(v).proposer_round))
                    if not self.persist(st):
                        self._attempt_failed(v, att, f"UNAVAILABLE: {self.store.failed}", retry=False)
                        return
                    self.node.acceptor.apply(st)
                elif not att.recovered_from and reply.code != pb.REFUSAL_PROMISED:
                    # our own fresh value fails our own check: send nothing (a value phase 1 adopted from
                    # another proposer is still carried to its end, with our vote against it)
                    att.refused(self.node_id, reply.reason, reply.code)
                    self._attempt_failed(v, att, f"own check: {reply.reason}", retry=False)
                    return
                self._broadcast_accept(v, att)
                self._step(v, att, att.on_accepted(self.node_id, reply))
            else:
                self._broadcast_accept(v, att)
        elif ev == "chosen":
            self._attempts.pop(v, None)
            self.timers.disarm("attempt", v)
            c = att.commit(int(self.clock.now() * 1000))
            pend = self.pending.get(v)
            if pend is not None and c.qc.table_hash == pend.value.table.content_hash:
                # the commit is known here: a quorum holds it durably. Our own log and the install follow.
                self._finish(v, Outcome(True, v, "", att.votes(), self.clock.now() - pend.t0, c))
            self.node.learned(c, None, broadcast=True, attempt=att)
        elif ev == "failed":
            self._attempt_failed(v, att, att.reason, retry=True)
        if att.max_head_seen[0] > self.node.log.head.version:
            self.node.catch_up(att.max_head_seen[1])

    def _attempt_timeout(self, v: int, att: BallotAttempt) -> None:
        if self._attempts.get(v) is att and not att.done:
            self._attempt_failed(v, att, f"no quorum within {self.cfg.accept_timeout_ms} ms "
                                 f"({len(att.promises) if att.phase == 1 else len(att.accepts)}/{att.quorum}): "
                                 f"{voters_not_counted(att)}", retry=True)

    def _attempt_failed(self, v: int, att: BallotAttempt, reason: str, retry: bool) -> None:
        att.done = True
        if self._attempts.get(v) is att:
            del self._attempts[v]
        self.timers.disarm("attempt", v)
        self.timers.disarm("thrifty", v)
        self._accept_rest.pop(v, None)
        pend = self.pending.get(v)
        if pend is None:
            return
        pend.votes = att.votes()
        pend.reasons.append(f"ballot {att.ballot}: {reason}")
        # a voter that is busy (rebuilding, deciding whether it may vote, on a failed disk) may take the next ballot
        contested = any(code in CONTESTED for code in att.reject_codes.values())
        verify_rejected = bool(att.rejects) and not contested
        if not retry or verify_rejected or pend.attempts >= self.cfg.max_attempts:
            self._finish(v, Outcome(False, v, "; ".join(pend.reasons), pend.votes, self.clock.now() - pend.t0))
            return
        min_round = att.max_round_seen + 1
        self.timers.arm("attempt", v, self.timeout * (0.5 + self.rng.random()),
                  lambda: self._start_attempt(v, fast=False, min_round=min_round)
                  if v == self.node.log.head.version + 1 and v not in self._attempts else None)

    def _finish(self, v: int, out: Outcome) -> None:
        pend = self.pending.pop(v, None)
        self.timers.disarm("takeover", v)
        if pend is not None:
            pend.on_done(out)

