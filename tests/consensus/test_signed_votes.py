"""Forged messages change nothing: under mTLS a quorum certificate must carry a verifiable signature of
every voter it names; in any mode a learned table is validated before it is installed, and ballot rounds
cannot be pushed out of reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import ConsensusConfig
from agent.consensus.paxos import MAX_ROUND, round0_owner
from agent.consensus.signing import VoteSigner
from agent.security import write_dev_certs
from chaos.checkers import check
from chaos.quorumsim import QuorumSim
from controlplane.table import RoutingTable
from elasticmoe.codec import table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb

IDS = ["n00", "n01", "n02"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    write_dev_certs(d, [*IDS, "mallory"])
    other = tmp_path_factory.mktemp("other-ca")
    write_dev_certs(other, ["n00"])  # same name, another CA
    return d, other


def _cluster(certs: tuple[Path, Path] | None) -> QuorumSim:
    signers = {n: VoteSigner.from_cert_dir(certs[0], n) for n in IDS} if certs else None
    c = QuorumSim(3, 3, 5, ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=0), signers=signers)
    c.run(0.1)
    c.propose(round0_owner(2, c.voters))
    c.run(0.3)
    assert set(c.heads().values()) == {2}
    return c


def _forge(c: QuorumSim, phy_fill: int | None = None) -> pb.Commit:
    """A commit of version 3 that no quorum voted for, naming two voters in its certificate."""
    head = c.nodes["n00"].head
    phy = head.phy2log.copy()
    if phy_fill is None:
        phy[0, [0, 1]] = phy[0, [1, 0]]  # a valid table
    else:
        phy[0, :] = phy_fill  # every slot of layer 0 holds one expert: invalid
    t = RoutingTable(head.topology, head.experts, phy, 3, 2, head.active_ranks)
    qc = pb.QuorumCertificate(version=3, ballot=pb.Ballot(round=0, node_id=round0_owner(3, IDS)),
                              table_hash=t.digest, voters=["n00", "n01"], quorum=2)
    return pb.Commit(table=table_to_pb(t), qc=qc, proposer="n00")


def _learn(c: QuorumSim, commit: pb.Commit, to: str = "n02") -> pb.CommitAck:
    r = c.nodes[to]._handle("mallory", "Consensus/Learn", commit)
    assert isinstance(r, pb.CommitAck)
    return r


def test_plaintext_forged_learn_of_an_invalid_table_is_refused() -> None:
    c = _cluster(None)
    r = _learn(c, _forge(c, phy_fill=0))
    assert not r.ok and "invalid table" in r.reason
    assert c.nodes["n02"].head.version == 2


def test_signed_commit_carries_a_verifiable_signature_per_voter(certs: tuple[Path, Path]) -> None:
    c = _cluster(certs)
    commit = c.nodes["n02"].log.commits[2]
    assert sorted(s.voter for s in commit.qc.signatures) == sorted(commit.qc.voters)
    assert VoteSigner.from_cert_dir(certs[0], "n01").check_certificate(commit, IDS) == ""
    c.propose("n01")  # and the cluster keeps committing with signatures
    c.run(0.5)
    assert set(c.heads().values()) == {3} and check(c.history) == []


def test_forged_certificates_are_refused_under_mtls(certs: tuple[Path, Path]) -> None:
    c = _cluster(certs)
    good = c.nodes["n02"].log.commits[2]
    forged = _forge(c)
    r = _learn(c, forged)  # names voters, carries no signature (the old certificate)
    assert not r.ok and "no signature of n00" in r.reason

    def signed_by(cert_dir: Path, name: str, as_voter: str) -> pb.VoteSignature:
        s = VoteSigner.from_cert_dir(cert_dir, name)
        qc = forged.qc
        sig = s.sign(3, (int(qc.ballot.round), qc.ballot.node_id), qc.table_hash)
        return pb.VoteSignature(voter=as_voter, certificate=s.cert_der, signature=sig)

    forged.qc.signatures.extend([signed_by(certs[0], "mallory", "n00"), signed_by(certs[0], "mallory", "n01")])
    r = _learn(c, forged)  # a member's (or any CA-issued) key cannot sign for a voter
    assert not r.ok and "signed with the certificate of 'mallory'" in r.reason
    del forged.qc.signatures[:]
    forged.qc.signatures.extend([signed_by(certs[1], "n00", "n00"), signed_by(certs[1], "n00", "n01")])
    r = _learn(c, forged)  # a certificate with the right name from another CA
    assert not r.ok and "not issued by the cluster CA" in r.reason
    del forged.qc.signatures[:]
    forged.qc.signatures.extend(good.qc.signatures)  # genuine signatures, replayed onto another table
    forged.qc.voters[:] = list(good.qc.voters)
    r = _learn(c, forged)
    assert not r.ok and "signature does not verify" in r.reason
    assert all(c.nodes[n].head.version == 2 for n in IDS) and check(c.history) == []


def test_a_genuine_commit_with_one_signature_altered_is_refused(certs: tuple[Path, Path]) -> None:
    """A real certificate of the next version (voters, ballot, table and certificates all genuine) with the
    bytes of one signature flipped, truncated or swapped for the other voter's: only the signature check can
    refuse it, and it does; the untouched certificate is then learned."""
    c = _cluster(certs)
    c.crash("n02")  # n00 and n01 commit version 3 without n02; n02 is then offered that commit
    owner = round0_owner(3, IDS)
    c.propose(owner if owner != "n02" else "n00")
    c.run(0.5)
    good = c.nodes["n00"].log.commits[3]
    c.restart("n02")
    assert c.nodes["n02"].head.version == 2 and len(good.qc.signatures) >= 2
    sig0 = good.qc.signatures[0].signature
    flips = [bytes([sig0[0]]) + bytes([sig0[1] ^ 1]) + sig0[2:], sig0[:-1] + bytes([sig0[-1] ^ 0x80]), sig0[:-2],
             good.qc.signatures[1].signature]
    for sig in flips:
        bad = pb.Commit()
        bad.CopyFrom(good)
        bad.qc.signatures[0].signature = sig
        r = _learn(c, bad)
        assert not r.ok and f"{good.qc.signatures[0].voter}: signature does not verify" in r.reason
        assert c.nodes["n02"].head.version == 2
    assert _learn(c, good).ok and c.nodes["n02"].head.version == 3
    assert check(c.history) == []


def test_a_prepare_far_beyond_any_round_seen_is_refused() -> None:
    c = _cluster(None)
    node = c.nodes["n02"]
    for rnd in (MAX_ROUND, 2**20):
        r = node._handle("n00", "Consensus/Prepare", pb.PrepareRequest(
            version=3, ballot=pb.Ballot(round=rnd, node_id="n00"), from_node="n00"))
        assert isinstance(r, pb.Promise) and not r.ok and "the highest round seen here" in r.reason
    assert node.acceptor.state(3).promised.round == 0  # nothing durable changed
    c.propose("n01")  # the next version stays proposable
    c.run(0.5)
    assert set(c.heads().values()) == {3}


def test_a_malformed_rival_of_a_committed_version_leaves_no_trace() -> None:
    """A 'certified' rival for a version already committed here that is not a whole table of that version
    (here: the wrong parent) is bad input: refused, and not recorded as a broken invariant (found by
    chaos.fuzz on Consensus/Learn)."""
    c = _cluster(None)
    node = c.nodes["n02"]
    head = node.head
    phy = head.phy2log.copy()
    phy[0, [0, 1]] = phy[0, [1, 0]]
    t = RoutingTable(head.topology, head.experts, phy, 2, 2, head.active_ranks)  # version 2 with parent 2
    forged = pb.Commit(table=table_to_pb(t), qc=pb.QuorumCertificate(
        version=2, ballot=pb.Ballot(round=1, node_id="n00"), table_hash=t.digest, voters=["n00", "n01"], quorum=2))
    r = _learn(c, forged)
    assert not r.ok and "parent 2: expected 1" in r.reason and node.conflicts == []


def _pause(c: QuorumSim, writer: str, paused: bool = True) -> pb.ControlCommit:
    out: list = []
    c.nodes[writer].control.write(paused, "emoe pause", out.append)
    c.run(0.5)
    assert out and out[0].committed and out[0].commit is not None, out
    return out[0].commit  # type: ignore[no-any-return]


def _control_learn(c: QuorumSim, commit: pb.ControlCommit, to: str = "n02") -> pb.ControlAck:
    r = c.nodes[to]._handle("mallory", "Consensus/ControlLearn", commit)
    assert isinstance(r, pb.ControlAck)
    return r


def _switch(c: QuorumSim) -> set[tuple[int, str, bool] | None]:
    return {None if (r := c.nodes[n].control.record) is None else (int(r.record.seq), r.record.node_id,
                                                                     r.record.paused) for n in IDS}


def test_a_signed_pause_names_only_voters_that_signed_it(certs: tuple[Path, Path]) -> None:
    c = _cluster(certs)
    commit = _pause(c, "n01")
    assert sorted(s.voter for s in commit.signatures) == sorted(commit.voters) and len(commit.voters) >= 2
    assert VoteSigner.from_cert_dir(certs[0], "n00").check_control(commit, lambda v: True) == ""
    assert _switch(c) == {(1, "n01", True)}


def test_a_forged_control_record_is_refused_under_mtls(certs: tuple[Path, Path]) -> None:
    """A member names a quorum for a resume that no voter accepted: refused unsigned, signed with its own key,
    with another CA's certificate for the name, and with the voters' genuine signatures of another record."""
    c = _cluster(certs)
    good = _pause(c, "n01")
    forged = pb.ControlCommit(record=pb.ControlRecord(seq=9, node_id="n00", paused=False, note="forged"),
                              voters=["n00", "n01"], quorum=2)
    r = _control_learn(c, forged)
    assert not r.ok and "no signature of n00" in r.reason

    def signed_by(cert_dir: Path, name: str, as_voter: str) -> pb.VoteSignature:
        s = VoteSigner.from_cert_dir(cert_dir, name)
        return pb.VoteSignature(voter=as_voter, certificate=s.cert_der, signature=s.sign_control(forged.record))

    forged.signatures.extend([signed_by(certs[0], "mallory", "n00"), signed_by(certs[0], "mallory", "n01")])
    r = _control_learn(c, forged)
    assert not r.ok and "signed with the certificate of 'mallory'" in r.reason
    del forged.signatures[:]
    forged.signatures.extend([signed_by(certs[1], "n00", "n00"), signed_by(certs[1], "n00", "n01")])
    r = _control_learn(c, forged)
    assert not r.ok and "not issued by the cluster CA" in r.reason
    del forged.signatures[:]
    forged.signatures.extend(good.signatures)  # genuine signatures, of the pause, onto the forged resume
    forged.voters[:] = list(good.voters)
    r = _control_learn(c, forged)
    assert not r.ok and "control signature does not verify" in r.reason
    assert _switch(c) == {(1, "n01", True)}
    # the votes' own signatures are not control signatures either (another domain)
    assert _control_learn(c, good).ok


def test_a_voter_on_the_release_before_may_be_named_unsigned(certs: tuple[Path, Path]) -> None:
    """A rolling upgrade: a voter whose answers say it runs the release before signs no control acks; its name
    is taken unsigned (and its ack counted) while every other voter must still sign."""
    c = _cluster(certs)
    for n in IDS:
        c.nodes[n].control.signs_control = lambda v: v != "n01"
    c.nodes["n01"].control.signer = None  # n01 runs the release before: its acks carry no signature
    c.crash("n02")  # so that the quorum must count n01's unsigned ack
    commit = _pause(c, "n00")
    assert commit.voters == ["n00", "n01"] and [s.voter for s in commit.signatures] == ["n00"]
    c.restart("n02")
    for n in IDS:
        c.nodes[n].control.signs_control = lambda v: v != "n01"
    assert _control_learn(c, commit).ok  # as its anti-entropy would hand it over
    assert _switch(c) == {(1, "n00", True)}
    s0 = VoteSigner.from_cert_dir(certs[0], "n00")
    rec = pb.ControlRecord(seq=4, node_id="n00", paused=False, note="emoe resume")
    signed0 = pb.VoteSignature(voter="n00", certificate=s0.cert_der, signature=s0.sign_control(rec))
    mixed = pb.ControlCommit(record=rec, voters=["n00", "n01"], quorum=2, signatures=[signed0])
    assert _control_learn(c, mixed).ok and c.nodes["n02"].control.record == mixed
    unsigned0 = pb.ControlCommit(record=pb.ControlRecord(seq=5, node_id="n00", paused=True),
                                 voters=["n00", "n01"], quorum=2)
    r = _control_learn(c, unsigned0)
    assert not r.ok and "no signature of n00" in r.reason
    # a record n01 wrote (the release before: it collects no signatures) names n00 unsigned, and stands
    by01 = pb.ControlCommit(record=pb.ControlRecord(seq=6, node_id="n01", paused=True), voters=["n00", "n01"],
                            quorum=2)
    assert _control_learn(c, by01).ok and c.nodes["n02"].control.record == by01
