"""A refusal's code, not its words, decides what a proposer does (consensus.proto `Refusal`): every refusal of
this release carries one; a verifier's words that happen to name "parent", "committed", "promised" or
UNAVAILABLE retry nothing; a reply of a release before codes is read by that release's rules
(agent/consensus/refusal.py)."""

from __future__ import annotations

import pytest

from agent.consensus.paxos import Acceptor, BallotAttempt, Verdict, ballot_pb, round0_owner
from agent.consensus.refusal import CONTESTED, control_refusal, legacy_refusal, refusal
from elasticmoe.v1 import consensus_pb2 as pb
from tests.consensus.test_consensus_node import cluster, commit_next

VOTERS = ["a", "b", "c"]


def _proposal(version: int, parent: int, rnd: int, node: str) -> pb.Proposal:
    return pb.Proposal(version=version, ballot=ballot_pb((rnd, node)), proposer=node,
                       table=pb.RoutingTable(version=version, parent=parent, content_hash=node.encode() * 8))


def test_every_acceptor_refusal_carries_its_code() -> None:
    acc = Acceptor("a", VOTERS)
    yes = lambda p: Verdict(True, 0.1, "")  # noqa: E731
    cases: list[tuple[pb.Promise | pb.Accepted, pb.Refusal]] = [
        (acc.on_prepare(pb.PrepareRequest(version=1, ballot=ballot_pb((1, "b"))), 1)[0], pb.REFUSAL_COMMITTED),
        (acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((0, "b"))), 1)[0], pb.REFUSAL_INVALID_ARGUMENT),
        (acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((2**63, "b"))), 1)[0],
         pb.REFUSAL_INVALID_ARGUMENT),
        (acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((2**20, "b"))), 1)[0],
         pb.REFUSAL_INVALID_ARGUMENT),
    ]
    promise, st = acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((5, "c"))), 1)
    assert promise.ok and promise.code == pb.REFUSAL_UNSPECIFIED and st is not None
    acc.apply(st)
    cases += [
        (acc.on_prepare(pb.PrepareRequest(version=2, ballot=ballot_pb((4, "b"))), 1)[0], pb.REFUSAL_PROMISED),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(1, 0, 6, "b")), 1, yes)[0], pb.REFUSAL_COMMITTED),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(2, 1, 2**63, "b")), 1, yes)[0],
         pb.REFUSAL_INVALID_ARGUMENT),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(3, 2, 0, "b")), 1, yes)[0], pb.REFUSAL_INVALID_ARGUMENT),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(2, 1, 4, "b")), 1, yes)[0], pb.REFUSAL_PROMISED),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(2, 0, 6, "b")), 1, yes)[0], pb.REFUSAL_PARENT_MISMATCH),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(2, 1, 6, "b")), 1,
                       lambda p: Verdict(False, 0.0, "replay worse"))[0], pb.REFUSAL_REJECTED),
        (acc.on_accept(pb.AcceptRequest(proposal=_proposal(2, 1, 6, "b")), 1,
                       lambda p: Verdict(False, 0.0, "wrong parent hash", pb.REFUSAL_PARENT_MISMATCH))[0],
         pb.REFUSAL_PARENT_MISMATCH),
    ]
    for reply, code in cases:
        assert not reply.ok and reply.reason and reply.code == code, (reply.reason, pb.Refusal.Name(reply.code))


@pytest.mark.parametrize("words", ["replay: the parent table's imbalance is lower", "committed head replays better",
                                   "UNAVAILABLE is what my replay calls this gain", "I promised myself no worse"])
def test_a_verifiers_words_retry_nothing(words: str) -> None:
    """The voters' verifier refuses the plan in words that name what a contested refusal names: the proposal
    fails after its one ballot, as any verdict does (before codes, "parent" in a reason retried it)."""
    c = cluster(max_attempts=4)
    owner = round0_owner(2, c.voters)
    for n in c.ids:
        if n != owner:
            c.nodes[n].verifier = lambda head, t, plan: (False, 0.0, words)
    commit_next(c)
    (who, out), = c.outcomes
    assert who == owner and not out.committed
    assert out.reason.count("ballot (") == 1, out.reason  # one ballot: not retried
    assert {v.reason for v in out.votes if not v.accept} == {words}


def test_a_contested_refusal_is_retried() -> None:
    """The other side of the rule: voters that may not vote now (UNAVAILABLE) are asked again at a higher
    ballot, up to max_attempts."""
    c = cluster(max_attempts=3)
    owner = round0_owner(2, c.voters)
    for n in c.ids:
        if n != owner:
            c.nodes[n].gate = lambda: "the cluster fingerprint differs"
    commit_next(c)
    c.run(2.0)
    (who, out), = c.outcomes
    assert who == owner and not out.committed
    assert out.reason.count("ballot (") == 3, out.reason


def test_a_refused_learn_says_why_as_a_code() -> None:
    c = cluster()
    commit_next(c)
    good = c.nodes[c.voters[0]].committed(2)
    assert good is not None
    bad = pb.Commit()
    bad.CopyFrom(good)
    bad.table.version = 3
    bad.table.parent = 2
    bad.qc.version = 3
    ack = c.nodes[c.voters[1]]._handle("x", "Consensus/Learn", bad)
    assert isinstance(ack, pb.CommitAck) and not ack.ok and ack.code == pb.REFUSAL_INVALID_ARGUMENT
    ok = c.nodes[c.voters[1]]._handle("x", "Consensus/Learn", good)  # known already: fine, no code
    assert isinstance(ok, pb.CommitAck) and ok.ok and ok.code == pb.REFUSAL_UNSPECIFIED


@pytest.mark.parametrize(("reason", "code"), [
    ("promised (3, 'b') > (2, 'a')", pb.REFUSAL_PROMISED),
    ("UNAVAILABLE: rebuilding after store loss", pb.REFUSAL_UNAVAILABLE),
    ("UNAVAILABLE: a promised ballot", pb.REFUSAL_PROMISED),  # that release also moved its round past it
    ("parent mismatch: proposal for version 3 on parent 1, committed head here 2", pb.REFUSAL_PARENT_MISMATCH),
    ("version 2 already committed here (head 4)", pb.REFUSAL_COMMITTED),
    ("GAIN_BELOW_TAU", pb.REFUSAL_REJECTED),
    ("INVALID_ARGUMENT: plan.cost = nan: expected a finite number", pb.REFUSAL_REJECTED),
])
def test_a_reply_of_a_release_before_codes_is_read_by_its_rules(reason: str, code: pb.Refusal) -> None:
    assert legacy_refusal(reason) == code
    old = pb.Accepted(ok=False, from_node="b", reason=reason)  # no code: as that release sends it
    assert refusal(old) == code
    assert (code in CONTESTED) == (code != pb.REFUSAL_REJECTED)
    # a reply with a code is read by its code alone, whatever its words
    assert refusal(pb.Accepted(ok=False, reason=reason, code=pb.REFUSAL_REJECTED)) == pb.REFUSAL_REJECTED


def test_a_code_less_promised_refusal_moves_the_round_past_it() -> None:
    att = BallotAttempt("a", 2, (1, "a"), VOTERS, _proposal(2, 1, 1, "a"))
    att.phase = 2
    att.on_accepted("b", pb.Accepted(ok=False, from_node="b", ballot=ballot_pb((1, "a")),
                                     reason="promised (4, 'c') > (1, 'a')"))
    assert att.max_round_seen == 2 and att.reject_codes == {"b": pb.REFUSAL_PROMISED}
    att.on_accepted("c", pb.Accepted(ok=False, from_node="c", ballot=ballot_pb((1, "a")),
                                     reason="promised, but in words only", code=pb.REFUSAL_REJECTED))
    assert att.reject_codes["c"] == pb.REFUSAL_REJECTED


def test_a_control_ack_of_a_release_before_codes() -> None:
    assert control_refusal(pb.ControlAck(reason="UNAVAILABLE: a learner")) == pb.CONTROL_UNAVAILABLE
    assert control_refusal(pb.ControlAck(reason="seq 3 is not above (4, 'b')")) == pb.CONTROL_REFUSAL_UNSPECIFIED
    coded = pb.ControlAck(reason="UNAVAILABLE in words", code=pb.CONTROL_SUPERSEDED)
    assert control_refusal(coded) == pb.CONTROL_SUPERSEDED
