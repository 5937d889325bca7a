"""Control records are accepted only from their writer (agent/consensus/control.py, Writer; issue 48, finding 1):
the acceptor's rule sans-IO; under mTLS on the simulated network, a record certified just before a partition is
still finished by the voters that hold it with its writer's signature, and a finish without that signature is
refused, counted and given up; the admin who asked enters the writer's signed word, and a certified record names
an admin only with it, while the voters sign what every release signs."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from agent.config import ConsensusConfig
from agent.consensus.control import ControlAcceptor, describe, key
from agent.consensus.controlnode import ControlOutcome
from agent.consensus.signing import VoteSigner, control_digest, writer_digest
from agent.security import write_dev_certs
from chaos.quorumsim import QuorumSim
from elasticmoe.v1 import consensus_pb2 as pb

IDS = [f"n{i:02d}" for i in range(5)]


def rec(seq: int, node: str, paused: bool = False) -> pb.ControlRecord:
    return pb.ControlRecord(seq=seq, node_id=node, paused=paused, at_ms=1, note="test")


def good(node: str) -> pb.VoteSignature:
    return pb.VoteSignature(voter=node, signature=b"by " + node.encode())


def fake_check(r: pb.ControlRecord, s: pb.VoteSignature) -> str:
    """A writer check without keys: the signature `good(r.node_id)` checks, any other does not."""
    return "" if s == good(r.node_id) else f"{r.node_id}: writer signature does not verify"


def test_a_voter_takes_a_record_from_its_writer_or_from_a_voter_with_the_writers_signature() -> None:
    a = ControlAcceptor("b", ["a", "b", "c"], is_member=lambda n: n == "m", check_writer=fake_check)
    ok, st = a.on_accept(rec(1, "a", paused=True), "a")  # from its writer
    assert ok.ok and st is not None
    a.apply(st)
    refusals = [  # (record, sender, writer's signature) -> code, each naming record.node_id and its value
        (rec(2, "admin"), "a", None, pb.CONTROL_UNKNOWN_WRITER),  # a name that is no voter and no member
        (rec(2, "c"), "m", good("c"), pb.CONTROL_NOT_WRITER),  # a member, not a voter, cannot finish another's
        (rec(2, "c"), "a", None, pb.CONTROL_WRITER_UNSIGNED),  # a voter finishing without the writer's word
        (rec(2, "c"), "a", good("a"), pb.CONTROL_WRITER_BAD_SIGNATURE),  # ... with its own instead
        (rec(2, "m"), "c", pb.VoteSignature(voter="m", signature=b"forged"), pb.CONTROL_WRITER_BAD_SIGNATURE),
    ]
    for r, src, sig, code in refusals:
        no, st2 = a.on_accept(r, src, sig)
        assert (no.ok, no.code, st2) == (False, code, None), (r, src, no)
        assert "PERMISSION_DENIED" in no.reason and f"record.node_id = {r.node_id!r}" in no.reason, no.reason
        assert key(no.accepted) == (1, "a") and not no.signature
    assert a.heard == (1, "a") and a.next_record(True, 5, "x").seq == 2  # a refused record moves nothing
    yes, st3 = a.on_accept(rec(2, "c"), "a", good("c"))  # a voter finishing c's record with c's signature
    assert yes.ok and st3 is not None and st3.writer == good("c")
    a.apply(st3)
    assert a.writer == good("c")  # kept with the record: this voter can finish it in turn
    own, st4 = a.on_accept(rec(3, "m"), "m")  # a member writes under its own name
    assert own.ok and st4 is not None and not st4.HasField("writer")  # (it sent no signature)

    plain = ControlAcceptor("b", ["a", "b", "c"], is_member=lambda n: n == "m")  # plaintext: no keys
    assert plain.on_accept(rec(1, "c"), "a")[0].ok  # a voter's word that it finishes is all there is
    for r, src, code in ((rec(2, "c"), "m", pb.CONTROL_NOT_WRITER), (rec(2, "admin"), "admin",
                                                                      pb.CONTROL_UNKNOWN_WRITER)):
        no, _ = plain.on_accept(r, src)
        assert not no.ok and no.code == code, no


def test_the_writer_signs_the_admin_and_the_voters_sign_what_every_release_signs() -> None:
    r = pb.ControlRecord(seq=7, node_id="node1", paused=True, at_ms=123, note="emoe pause", admin="alice")
    # a voter signs fields 1 to 5, the bytes the release before signs too, so that either checks the other's
    legacy = (b"elasticmoe/v1 control\x00" + struct.pack("<QBQ", 7, 1, 123) + struct.pack("<I", 5) + b"node1"
              + struct.pack("<I", 10) + b"emoe pause")
    assert control_digest(r) == legacy
    bob = pb.ControlRecord()
    bob.CopyFrom(r)
    bob.admin = "bob"
    assert writer_digest(r) != writer_digest(bob)  # the writer's word names the admin
    assert writer_digest(r)[-9:] == struct.pack("<I", 5) + b"alice" and not writer_digest(r).startswith(legacy)
    assert describe(pb.ControlCommit(record=r)) == "paused by node1 for admin alice (record 7)"


@pytest.fixture(scope="module")
def signers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, VoteSigner]:
    d: Path = tmp_path_factory.mktemp("tls")
    write_dev_certs(d, IDS)
    return {n: VoteSigner.from_cert_dir(d, n) for n in IDS}


def _cluster(signers: dict[str, VoteSigner]) -> QuorumSim:
    c = QuorumSim(5, 5, 3, ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=200), signers=signers)
    c.run(0.2)
    return c


def _switch(c: QuorumSim, nodes: list[str]) -> set[tuple[int, str, bool] | None]:
    return {None if (r := c.nodes[n].control.record) is None else (int(r.record.seq), r.record.node_id,
                                                                     r.record.paused) for n in nodes}


def _pause_then_cut(c: QuorumSim, w: str) -> list[str]:
    """`w` pauses and is cut off the moment it knows its record certified (its learns are lost): the others."""
    rest = [n for n in c.ids if n != w]
    c.nodes[w].control.on_change(lambda cm: c.net.partition([[w], rest]))
    out: list[ControlOutcome] = []
    c.nodes[w].control.write(True, "emoe pause", out.append, admin="alice")
    c.run(0.1)  # (a finish starts only `deadline` = 0.4 s after an accept)
    assert out and out[0].committed and out[0].commit is not None, out
    assert all(c.nodes[n].control.record is None for n in rest)  # nobody learned it from the writer
    return rest


def test_a_record_certified_just_before_a_partition_is_finished_with_its_writers_signature(
        signers: dict[str, VoteSigner]) -> None:
    c = _cluster(signers)
    w = c.voters[0]
    rest = _pause_then_cut(c, w)
    holders = [n for n in rest if c.nodes[n].control.acceptor.accepted is not None]
    assert holders and all(signers[w].check_writer(c.nodes[n].control.acceptor.accepted,  # type: ignore[arg-type]
                                                   c.nodes[n].control.acceptor.writer) == "" for n in holders)
    c.run(3.0)  # the voters that accepted it finish it on their side, showing the others w's signature
    assert _switch(c, rest) == {(1, w, True)}
    assert {c.nodes[n].control.record.record.admin for n in rest} == {"alice"}  # type: ignore[union-attr]
    assert not any(c.nodes[n].control.refused for n in rest)


def test_a_finish_without_the_writers_signature_is_refused_counted_and_given_up(
        signers: dict[str, VoteSigner]) -> None:
    c = _cluster(signers)
    w = c.voters[0]
    rest = _pause_then_cut(c, w)
    for n in rest:  # as if each voter had accepted it from a release that sends no writer signature
        node = c.nodes[n].control
        if node.acceptor.accepted is not None:
            node.acceptor.writer = None
    c.run(3.0)
    assert _switch(c, rest) == {None}  # nobody may finish it: another voter's word is not the writer's
    refused = [c.nodes[n].control.refused.get("CONTROL_WRITER_UNSIGNED", 0) for n in rest]
    assert sum(refused) >= 1, refused
    c.run(3.0)  # each holder gave it up after one refused finish: no new refusals
    assert [c.nodes[n].control.refused.get("CONTROL_WRITER_UNSIGNED", 0) for n in rest] == refused
    c.net.heal()
    c.run(2.0)  # the writer's own learns (anti-entropy) still bring the certified record everywhere
    assert _switch(c, c.ids) == {(1, w, True)}


def test_a_certified_record_names_an_admin_only_with_its_writers_signature(signers: dict[str, VoteSigner]) -> None:
    c = _cluster(signers)
    w = c.voters[0]
    out: list[ControlOutcome] = []
    c.nodes[w].control.write(True, "emoe pause", out.append, admin="alice")
    c.run(0.5)
    assert out and out[0].committed and out[0].commit is not None, out
    good_commit = out[0].commit
    assert good_commit.record.admin == "alice" and signers[w].check_writer(good_commit.record, good_commit.writer) == ""
    assert _switch(c, c.ids) == {(1, w, True)}
    forged = pb.ControlCommit()
    forged.CopyFrom(good_commit)
    forged.record.seq, forged.record.paused = 2, False  # a resume the voters never signed: refused as ever
    other = pb.ControlCommit()
    other.CopyFrom(good_commit)
    other.record.seq = 2  # re-signed by a quorum below, so that only the admin's signature is wrong or missing
    other.record.admin = "mallory"
    other.ClearField("signatures")
    other.signatures.extend(pb.VoteSignature(voter=v, certificate=signers[v].cert_der,
                                             signature=signers[v].sign_control(other.record)) for v in other.voters)
    unsigned = pb.ControlCommit()
    unsigned.CopyFrom(other)
    unsigned.ClearField("writer")
    to = next(n for n in c.ids if n != w)
    node = c.nodes[to].control
    for bad, why in ((forged, "control signature does not verify"), (other, "writer signature does not verify"),
                     (unsigned, "without the signature of its writer")):
        ack = node.handle("n99", bad)
        assert isinstance(ack, pb.ControlAck) and not ack.ok and ack.code == pb.CONTROL_BAD_COMMIT, ack
        assert why in ack.reason, ack.reason
    assert node.refused == {"CONTROL_BAD_COMMIT": 3} and _switch(c, c.ids) == {(1, w, True)}
