"""The sans-IO Paxos core by direct message passing, plus a property test over random interleavings."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.consensus.paxos import (
    Acceptor,
    BallotAttempt,
    Verdict,
    ballot_pb,
    check_certificate,
    quorum_size,
    round0_owner,
)
from elasticmoe.v1 import consensus_pb2 as pb

VOTERS = ["a", "b", "c", "d", "e"]


def ok(p: pb.Proposal) -> Verdict:
    return Verdict(True, 0.1, "")


def value(name: str, version: int = 2, parent: int = 1) -> pb.Proposal:
    return pb.Proposal(version=version, proposer=name,
                       table=pb.RoutingTable(version=version, parent=parent, content_hash=name.encode() * 4))


def test_quorum_and_owner() -> None:
    assert [quorum_size(n) for n in (1, 2, 3, 4, 5, 64)] == [1, 2, 2, 3, 3, 33]
    assert [round0_owner(v, ["c", "a", "b"]) for v in range(4)] == ["a", "b", "c", "a"]


def test_round0_only_for_its_owner_and_never_in_a_prepare() -> None:
    acc = Acceptor("a", VOTERS)
    owner = round0_owner(2, VOTERS)
    p = value("x")
    p.ballot.CopyFrom(ballot_pb((0, "e" if owner != "e" else "d")))
    reply, st_ = acc.on_accept(pb.AcceptRequest(proposal=p), 1, ok)
    assert not reply.ok and "belongs to" in reply.reason and st_ is None
    p.ballot.CopyFrom(ballot_pb((0, owner)))
    reply, st_ = acc.on_accept(pb.AcceptRequest(proposal=p), 1, ok)
    assert reply.ok and st_ is not None
    promise, st2 = acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((0, "z"))), 1)
    assert not promise.ok and "round >= 1" in promise.reason and st2 is None


def test_acceptor_rejections_name_their_reason() -> None:
    acc = Acceptor("a", VOTERS)
    promise, st_ = acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((3, "b"))), 1)
    assert promise.ok and st_ is not None
    acc.apply(st_)
    low = value("x")
    low.ballot.CopyFrom(ballot_pb((2, "e")))
    reply, _ = acc.on_accept(pb.AcceptRequest(proposal=low), 1, ok)
    assert not reply.ok and "promised (3, 'b')" in reply.reason
    hi = value("x", parent=0)
    hi.ballot.CopyFrom(ballot_pb((4, "c")))
    reply, _ = acc.on_accept(pb.AcceptRequest(proposal=hi), 1, ok)
    assert not reply.ok and "parent mismatch" in reply.reason
    good = value("x")
    good.ballot.CopyFrom(ballot_pb((4, "c")))
    reply, _ = acc.on_accept(pb.AcceptRequest(proposal=good), 1, lambda p: Verdict(False, 0.01, "replay worse: 0.01 < 0.1"))
    assert not reply.ok and reply.reason == "replay worse: 0.01 < 0.1"
    reply, _ = acc.on_accept(pb.AcceptRequest(proposal=good), 2, ok)
    assert not reply.ok and "already committed" in reply.reason


def test_phase1_adopts_highest_accepted_value() -> None:
    att = BallotAttempt("e", 2, (5, "e"), VOTERS, value("mine"))
    old, new = value("old"), value("new")
    for src, b, v in (("a", (1, "a"), old), ("b", (3, "c"), new)):
        m = pb.Promise(ok=True, from_node=src, promised=ballot_pb((5, "e")), accepted_ballot=ballot_pb(b), accepted=v)
        assert att.on_promise(src, m) == ""
    assert att.on_promise("c", pb.Promise(ok=True, from_node="c", promised=ballot_pb((5, "e")))) == "accept"
    assert att.value is not None and att.value.proposer == "new" and att.recovered_from
    req = att.accept_request()
    assert (req.proposal.ballot.round, req.proposal.ballot.node_id) == (5, "e")
    for src in ("a", "b"):
        assert att.on_accepted(src, pb.Accepted(ok=True, from_node=src, ballot=ballot_pb((5, "e")))) == ""
    assert att.on_accepted("c", pb.Accepted(ok=False, from_node="c", ballot=ballot_pb((5, "e")), reason="no")) == ""
    assert att.on_accepted("d", pb.Accepted(ok=True, from_node="d", ballot=ballot_pb((5, "e")))) == "chosen"
    c = att.commit(0)
    assert check_certificate(c, VOTERS) == "" and list(c.qc.voters) == ["a", "b", "d"]
    assert [(v.voter, v.accept) for v in c.votes] == [("a", True), ("b", True), ("d", True), ("c", False)]


def test_attempt_fails_once_a_quorum_is_out_of_reach() -> None:
    att = BallotAttempt("e", 2, (1, "e"), VOTERS, value("mine"))
    for i, src in enumerate("abc"):
        m = pb.Promise(ok=False, from_node=src, promised=ballot_pb((7, "b")), reason="promised higher")
        assert att.on_promise(src, m) == ("failed" if i == 2 else "")
    assert att.max_round_seen == 7 and "a: promised higher" in att.reason


def test_certificate_checks() -> None:
    good = pb.Commit(table=pb.RoutingTable(version=2, content_hash=b"h"),
                     qc=pb.QuorumCertificate(version=2, table_hash=b"h", voters=["a", "b", "c"], quorum=3))
    assert check_certificate(good, VOTERS) == ""
    cases = {
        "qc.version": dict(version=3),
        "table_hash": dict(table_hash=b"x"),
        "qc.quorum": dict(quorum=2),
        "duplicates": dict(voters=["a", "a", "b"]),
        "non-voters": dict(voters=["a", "b", "z"]),
        "at least": dict(voters=["a", "b"]),
    }
    for why, change in cases.items():
        bad = pb.Commit()
        bad.CopyFrom(good)
        for k, v in change.items():
            if k == "voters":
                del bad.qc.voters[:]
                bad.qc.voters.extend(v)  # type: ignore[arg-type]
            else:
                setattr(bad.qc, k, v)
        assert why in check_certificate(bad, VOTERS), why
    assert "no quorum certificate" in check_certificate(pb.Commit(table=good.table), VOTERS)


# ---- property: random interleavings never choose two values ---------------------------------------
@settings(max_examples=150, deadline=None)
@given(n_voters=st.sampled_from([3, 5]), choices=st.lists(st.integers(0, 10_000), min_size=20, max_size=250))
def test_random_interleavings_choose_at_most_one_value(n_voters: int, choices: list[int]) -> None:
    voters = VOTERS[:n_voters]
    acceptors = {v: Acceptor(v, voters) for v in voters}
    proposers = ["a", "b", "z"]  # z is not a voter
    rounds = dict.fromkeys(proposers, 0)
    attempts: dict[str, BallotAttempt] = {}
    net: list[tuple[str, str, object]] = []  # (dst, src, msg) in flight
    accepted_by: dict[tuple[tuple[int, str], bytes], set[str]] = defaultdict(set)
    committed: set[bytes] = set()
    it = iter(choices)

    def start(p: str) -> None:
        rounds[p] += 1
        r = 0 if rounds[p] == 1 and p == round0_owner(2, voters) else rounds[p]
        rounds[p] = max(rounds[p], r)
        att = BallotAttempt(p, 2, (r, p), voters, value(p))
        attempts[p] = att
        req: object = att.accept_request() if r == 0 else att.prepare_request()
        net.extend((v, p, req) for v in voters)

    for p in proposers:
        start(p)
    for c in it:
        if not net:
            start(proposers[c % 3])
            continue
        dst, src, msg = net.pop(c % len(net))
        action = (c // 7) % 10
        if action == 0:
            continue  # lost
        if action == 1:
            net.append((dst, src, msg))  # duplicated
        if isinstance(msg, pb.PrepareRequest):
            reply, s = acceptors[dst].on_prepare(msg, 1)
            if s is not None:
                acceptors[dst].apply(s)
            net.append((src, dst, reply))
        elif isinstance(msg, pb.AcceptRequest):
            reply2, s = acceptors[dst].on_accept(msg, 1, ok)
            if s is not None:
                acceptors[dst].apply(s)
                b = (msg.proposal.ballot.round, msg.proposal.ballot.node_id)
                accepted_by[(b, msg.proposal.table.content_hash)].add(dst)
            net.append((src, dst, reply2))
        else:
            att = attempts[dst]
            ev = att.on_promise(src, msg) if isinstance(msg, pb.Promise) else att.on_accepted(src, msg)  # type: ignore[arg-type]
            if ev == "accept":
                net.extend((v, dst, att.accept_request()) for v in voters)
            elif ev == "chosen":
                committed.add(att.commit(0).qc.table_hash)
            elif ev == "failed" or (c % 13 == 0):
                start(dst)  # retry at a higher round (possibly abandoning the current one)
    chosen = {h for (_, h), who in accepted_by.items() if len(who) >= quorum_size(len(voters))}
    assert len(chosen) <= 1, f"two values chosen: {chosen}"
    assert committed <= chosen


def test_turn_distance_orders_every_live_voter_after_the_planner() -> None:
    from agent.consensus.paxos import planner_turn, turn_distance

    voters, live = ["a", "b", "c", "d"], ["a", "b", "d"]  # c is down
    for w in range(8):
        planner = planner_turn(5, voters, live, w, 2)
        places = {n: turn_distance(5, voters, live, w, 2, n) for n in live}
        assert places[planner] == 0 and sorted(places.values()) == [0, 1, 2], (w, places)
    assert turn_distance(5, voters, live, 0, 2, "c") == 3  # not a live voter: after all of them
    assert turn_distance(5, voters, [], 0, 2, "a") == 0
