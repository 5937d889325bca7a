"""Sans-IO single-decree Paxos, one instance per routing-table version.

No clock, no network, no disk: each handler takes a message and returns the reply plus the acceptor state
the caller must persist (fsync) *before* it sends that reply (etcd-raft's Ready order).

Ballots are `(round, node_id)` compared lexicographically. Round 0 of version v belongs to exactly one node,
`round0_owner(v, voters)`, which may skip phase 1: no ballot is lower, so no value can have been chosen
before it. The owner is a function of the *configured* voters only, never of a liveness view: if two nodes
could both use round 0 (say (0,a) < (0,b)) with different values, a value chosen at (0,a) could be
overridden, because a later prepare would see (0,b) as the highest accepted ballot and re-propose its value.
A node whose liveness view says the owner is down skips straight to a prepare at round >= 1 instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from agent.consensus.refusal import Refusal, refusal
from elasticmoe.v1 import consensus_pb2 as pb

Ballot = tuple[int, str]
NO_BALLOT: Ballot = (0, "")  # below every real ballot: "" sorts before any node id
# Rounds grow by one per attempt, so a real proposer never gets near this; a ballot above it (say 2^64 - 1
# from a hostile or corrupt peer) would be unbeatable and make the next proposer's round overflow uint64.
MAX_ROUND = 2**62
# ... and a ballot may lead the highest round this acceptor has seen for the version by at most this much: an
# honest proposer moves one round past the highest it has heard of, so a forged round near MAX_ROUND (which
# would leave the version unproposable, durably) is refused, and pushing rounds up takes 2^46 messages.
MAX_ROUND_STEP = 2**16



class Verdict(NamedTuple):
    """A voter's own check of a proposal: accept?, its verified gain, and when not, why in words and as a code
    (REFUSAL_REJECTED: the plan's verifier said no; agent.consensus.node's own table checks say otherwise)."""

    ok: bool
    gain: float
    reason: str
    code: Refusal = pb.REFUSAL_REJECTED


ProposalCheck = Callable[[pb.Proposal], Verdict]


def ballot_of(m: pb.Ballot) -> Ballot:
    return (int(m.round), m.node_id)


def ballot_pb(b: Ballot) -> pb.Ballot:
    return pb.Ballot(round=b[0], node_id=b[1])


def quorum_size(n_voters: int) -> int:
    """A majority of the configured voters."""
    return n_voters // 2 + 1


def round0_owner(version: int, voters: Iterable[str]) -> str:
    """The one node allowed to use round 0 (phase 2 only) for `version`: a rotation over the voters."""
    vs = sorted(set(voters))
    return vs[version % len(vs)]


def planner_turn(version: int, voters: Iterable[str], live: Iterable[str], windows_since_head: int,
                 handover: int) -> str | None:
    """Who plans the next window for `version`: the live voters in round-0 order (its round-0 owner first),
    the turn passing on every `handover` windows without a new head; None if no voter is live."""
    return turn(version, voters, live, windows_since_head, handover, "")[0]


def turn_distance(version: int, voters: Iterable[str], live: Iterable[str], windows_since_head: int,
                  handover: int, me: str) -> int:
    """How many places after this window's planner (planner_turn) `me` comes in the turn order: 0 if it is the
    planner; a node outside the order (not a live voter) comes after every live voter."""
    return turn(version, voters, live, windows_since_head, handover, me)[1]


def turn(version: int, voters: Iterable[str], live: Iterable[str], windows_since_head: int, handover: int,
         me: str) -> tuple[str | None, int]:
    """planner_turn and turn_distance from one walk of the turn order (an agent needs both every window)."""
    vs, up = sorted(set(voters)), set(live)
    order = [x for x in (vs[(version + i) % len(vs)] for i in range(len(vs))) if x in up]
    if not order:
        return None, 0
    p = (max(0, windows_since_head) // handover) % len(order)
    return order[p], (order.index(me) - p) % len(order) if me in order else len(order)


def _state_ballot(m: pb.AcceptorState, name: str) -> Ballot:
    return ballot_of(getattr(m, name)) if m.HasField(name) else NO_BALLOT


class Acceptor:
    """Promise/accept for every undecided version. `states` is what the store recovered."""

    def __init__(self, node_id: str, voters: Iterable[str], states: dict[int, pb.AcceptorState] | None = None) -> None:
        self.node_id = node_id
        self.voters = sorted(set(voters))
        self.states: dict[int, pb.AcceptorState] = dict(states or {})

    def state(self, version: int) -> pb.AcceptorState:
        st = self.states.get(version)
        return st if st is not None else pb.AcceptorState(version=version)

    def states_above(self, version: int) -> list[pb.AcceptorState]:
        """The acceptor state of every version above `version`, in order: what a rewritten log must keep."""
        return [st for k, st in sorted(self.states.items()) if k > version]

    def promised(self, version: int) -> Ballot:
        return _state_ballot(self.state(version), "promised")

    def accepted(self, version: int) -> tuple[Ballot, pb.Proposal | None]:
        st = self.state(version)
        if not st.HasField("accepted"):
            return NO_BALLOT, None
        return _state_ballot(st, "accepted_ballot"), st.accepted

    def apply(self, st: pb.AcceptorState) -> None:
        """Adopt a state once it is durable."""
        self.states[st.version] = st

    def prune(self, head: int) -> None:
        """Forget decided versions (the committed log answers for them)."""
        for v in [v for v in self.states if v <= head]:
            del self.states[v]

    # ---- phase 1 ---------------------------------------------------------------------------------
    def on_prepare(self, req: pb.PrepareRequest, head: int) -> tuple[pb.Promise, pb.AcceptorState | None]:
        v, b = int(req.version), ballot_of(req.ballot)
        no = pb.Promise(ok=False, from_node=self.node_id, committed_head=head)
        if v <= head:
            no.reason, no.code = f"version {v} already committed here (head {head})", pb.REFUSAL_COMMITTED
            return no, None
        if b[0] == 0:
            no.reason, no.code = "round 0 is phase-2-only: a prepare needs round >= 1", pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        if b[0] > MAX_ROUND:
            no.reason, no.code = f"ballot.round = {b[0]}: expected <= {MAX_ROUND}", pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        st = self.state(v)
        promised = _state_ballot(st, "promised")
        ceiling = _round_ceiling(st)
        if b[0] > ceiling:
            no.reason = f"ballot.round = {b[0]}: expected <= {ceiling} (the highest round seen here + {MAX_ROUND_STEP})"
            no.code = pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        if b <= promised:
            no.reason, no.code = f"promised {promised} >= {b}", pb.REFUSAL_PROMISED
            no.promised.CopyFrom(ballot_pb(promised))
            return no, None
        new = pb.AcceptorState()
        new.CopyFrom(st)
        new.promised.CopyFrom(req.ballot)
        yes = pb.Promise(ok=True, from_node=self.node_id, committed_head=head)
        yes.promised.CopyFrom(req.ballot)
        if st.HasField("accepted"):
            yes.accepted_ballot.CopyFrom(st.accepted_ballot)
            yes.accepted.CopyFrom(st.accepted)
        return yes, new

    # ---- phase 2 ---------------------------------------------------------------------------------
    def on_accept(self, req: pb.AcceptRequest, head: int, check: ProposalCheck) -> tuple[pb.Accepted, pb.AcceptorState | None]:
        p = req.proposal
        v, b = int(p.version), ballot_of(p.ballot)
        no = pb.Accepted(ok=False, from_node=self.node_id, committed_head=head)
        no.ballot.CopyFrom(p.ballot)
        if v <= head:
            no.reason, no.code = f"version {v} already committed here (head {head})", pb.REFUSAL_COMMITTED
            return no, None
        if b[0] > MAX_ROUND:
            no.reason, no.code = f"ballot.round = {b[0]}: expected <= {MAX_ROUND}", pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        if b[0] == 0 and b[1] != round0_owner(v, self.voters):
            no.reason = f"round 0 of version {v} belongs to {round0_owner(v, self.voters)}, not {b[1]}"
            no.code = pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        st = self.state(v)
        promised = _state_ballot(st, "promised")
        ceiling = _round_ceiling(st)
        if b[0] > ceiling:
            no.reason = f"ballot.round = {b[0]}: expected <= {ceiling} (the highest round seen here + {MAX_ROUND_STEP})"
            no.code = pb.REFUSAL_INVALID_ARGUMENT
            return no, None
        if b < promised:
            no.reason, no.code = f"promised {promised} > {b}", pb.REFUSAL_PROMISED
            return no, None
        if v != head + 1 or p.table.parent != head:
            no.reason = f"parent mismatch: proposal for version {v} on parent {p.table.parent}, committed head here {head}"
            no.code = pb.REFUSAL_PARENT_MISMATCH
            return no, None
        same = st.HasField("accepted") and st.accepted.table.content_hash == p.table.content_hash
        if same:
            gain = st.accepted.plan.verified_gain
        else:
            verdict = check(p)
            if not verdict.ok:
                no.reason, no.code = verdict.reason, verdict.code
                no.verified_gain = verdict.gain
                return no, None
            gain = verdict.gain
        new = pb.AcceptorState()
        new.CopyFrom(st)
        new.promised.CopyFrom(p.ballot)
        new.accepted_ballot.CopyFrom(p.ballot)
        new.accepted.CopyFrom(p)
        yes = pb.Accepted(ok=True, from_node=self.node_id, committed_head=head, verified_gain=gain)
        yes.ballot.CopyFrom(p.ballot)
        return yes, new


@dataclass
class BallotAttempt:
    """One ballot of one proposer for one version: phase 1 (unless round 0), phase 2, certificate.

    Feed it replies with `on_promise` / `on_accepted`; each returns "accept" (phase 1 done: send
    `accept_request()` to every voter), "chosen" (a quorum accepted: build `commit()`), "failed"
    (a quorum can no longer be reached: see `reason` and `max_round_seen`) or "" (nothing yet).
    """

    node_id: str
    version: int
    ballot: Ballot
    voters: list[str]
    value: pb.Proposal | None  # our own value; replaced by the highest accepted one phase 1 finds
    phase: int = 1
    promises: dict[str, pb.Promise] = field(default_factory=dict)
    accepts: dict[str, pb.Accepted] = field(default_factory=dict)
    rejects: dict[str, str] = field(default_factory=dict)  # voter -> why it refused, in words
    reject_codes: dict[str, Refusal] = field(default_factory=dict)  # ... and as a code (agent.consensus.refusal)
    max_round_seen: int = 0
    max_head_seen: tuple[int, str] = (0, "")
    recovered_from: str = ""  # set when phase 1 adopted a value another proposer had got accepted
    reason: str = ""
    done: bool = False

    def __post_init__(self) -> None:
        self.voters = sorted(set(self.voters))
        self.quorum = quorum_size(len(self.voters))
        if self.ballot[0] == 0:
            if self.value is None:
                raise ValueError(f"round 0 of version {self.version} needs a value")
            self.phase = 2

    def prepare_request(self) -> pb.PrepareRequest:
        return pb.PrepareRequest(version=self.version, ballot=ballot_pb(self.ballot), from_node=self.node_id)

    def accept_request(self) -> pb.AcceptRequest:
        if self.value is None:
            raise ValueError(f"no value to propose for version {self.version}")
        p = pb.Proposal()
        p.CopyFrom(self.value)
        p.version = self.version
        p.ballot.CopyFrom(ballot_pb(self.ballot))
        return pb.AcceptRequest(proposal=p, from_node=self.node_id)

    def refused(self, src: str, reason: str, code: Refusal) -> None:
        """Record `src`'s refusal of this ballot (its words, and its code)."""
        self.rejects[src] = reason
        self.reject_codes[src] = code

    def _note(self, src: str, head: int, m: pb.Promise | pb.Accepted, promised: Ballot) -> None:
        if head > self.max_head_seen[0]:
            self.max_head_seen = (head, src)
        if not m.ok:
            self.refused(src, m.reason, refusal(m))
            self.max_round_seen = max(self.max_round_seen, promised[0])

    def _fail_if_hopeless(self) -> str:
        if len(self.rejects) > len(self.voters) - self.quorum:
            self.done = True
            self.reason = "; ".join(f"{k}: {v}" for k, v in sorted(self.rejects.items()))
            return "failed"
        return ""

    def on_promise(self, src: str, m: pb.Promise) -> str:
        if self.done or self.phase != 1 or src not in self.voters or src in self.promises or src in self.rejects:
            return ""
        if ballot_of(m.promised) != self.ballot and m.ok:
            return ""  # a reply to another ballot of ours
        self._note(src, int(m.committed_head), m, ballot_of(m.promised))
        if not m.ok:
            return self._fail_if_hopeless()
        self.promises[src] = m
        if len(self.promises) < self.quorum:
            return ""
        best: tuple[Ballot, pb.Promise] | None = None
        for k in sorted(self.promises):
            pm = self.promises[k]
            if pm.HasField("accepted") and pm.accepted.version == self.version:
                b = ballot_of(pm.accepted_ballot)
                if best is None or b > best[0]:
                    best = (b, pm)
        if best is not None:
            adopted = best[1].accepted
            if self.value is None or adopted.table.content_hash != self.value.table.content_hash:
                self.recovered_from = f"{best[0]} via {best[1].from_node}"
            self.value = adopted
        if self.value is None:
            self.done = True
            self.reason = f"nothing accepted for version {self.version} in a quorum of promises, and no value of ours"
            return "failed"
        self.phase = 2
        return "accept"

    def on_accepted(self, src: str, m: pb.Accepted) -> str:
        if self.done or self.phase != 2 or src not in self.voters or src in self.accepts or src in self.rejects:
            return ""
        if ballot_of(m.ballot) != self.ballot:
            return ""
        self._note(src, int(m.committed_head), m, NO_BALLOT)
        if not m.ok:
            if self.reject_codes[src] == pb.REFUSAL_PROMISED:
                self.max_round_seen = max(self.max_round_seen, self.ballot[0] + 1)
            return self._fail_if_hopeless()
        self.accepts[src] = m
        if len(self.accepts) >= self.quorum:
            self.done = True
            return "chosen"
        return ""

    def votes(self) -> list[pb.Vote]:
        out = [pb.Vote(voter=k, accept=True, verified_gain=a.verified_gain) for k, a in sorted(self.accepts.items())]
        out += [pb.Vote(voter=k, accept=False, reason=r) for k, r in sorted(self.rejects.items())]
        return out

    def commit(self, committed_at_ms: int) -> pb.Commit:
        if self.value is None or len(self.accepts) < self.quorum:
            raise ValueError(f"version {self.version}: no quorum of accepts ({len(self.accepts)}/{self.quorum})")
        qc = pb.QuorumCertificate(
            version=self.version,
            ballot=ballot_pb(self.ballot),
            table_hash=self.value.table.content_hash,
            voters=sorted(self.accepts),
            quorum=self.quorum,
            signatures=[pb.VoteSignature(voter=k, certificate=a.certificate, signature=a.signature)
                        for k, a in sorted(self.accepts.items()) if a.signature],
        )
        return pb.Commit(table=self.value.table, qc=qc, plan=self.value.plan, votes=self.votes(),
                         proposer=self.value.proposer, committed_at_ms=committed_at_ms)


def _round_ceiling(st: pb.AcceptorState) -> int:
    """The highest ballot round an acceptor with state `st` takes for its version."""
    seen = max(_state_ballot(st, "promised")[0], int(st.accepted_ballot.round) if st.HasField("accepted") else 0)
    return min(MAX_ROUND, seen + MAX_ROUND_STEP)


def check_certificate(c: pb.Commit, voters: Iterable[str]) -> str:
    """Why `c` is not a valid certificate for the configured `voters`, or "" if it is. The table's content
    hash itself is checked when the table is decoded (wire.table_from_pb)."""
    vs = set(voters)
    qc = c.qc
    if not c.HasField("qc"):
        return "commit has no quorum certificate"
    if qc.version != c.table.version:
        return f"qc.version = {qc.version}: expected the table's version {c.table.version}"
    if qc.table_hash != c.table.content_hash or not qc.table_hash:
        return "qc.table_hash does not match the table's content hash"
    need = quorum_size(len(vs))
    if qc.quorum != need:
        return f"qc.quorum = {qc.quorum}: expected a majority of {len(vs)} voters = {need}"
    signers = list(qc.voters)
    if len(set(signers)) != len(signers):
        return f"qc.voters has duplicates: {signers}"
    strangers = sorted(set(signers) - vs)
    if strangers:
        return f"qc.voters names non-voters {strangers}"
    if len(signers) < need:
        return f"qc.voters has {len(signers)} voters: expected at least {need}"
    return ""
